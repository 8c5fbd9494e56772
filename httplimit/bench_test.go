package httplimit_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/ratelimit"
)

// grantAll is a Decider that grants everything without a database: the benchmark measures the
// middleware's own work (keys, HMACs, Structured Fields), not the decision.
type grantAll struct{}

func (grantAll) LimitMany(_ context.Context, reqs []ratelimit.Request, _ *ratelimit.LimitOpts) (ratelimit.ManyResult, error) {
	res := ratelimit.ManyResult{OK: true, Time: t0, Results: make([]ratelimit.Result, len(reqs))}
	for i, r := range reqs {
		res.Results[i] = ratelimit.Result{Name: r.Name, Key: r.Key, OK: true, Value: 7.5, Time: t0}
	}
	return res, nil
}

// go test -run '^$' -bench BenchmarkMiddleware ./httplimit/
func BenchmarkMiddleware(b *testing.B) {
	m, err := httplimit.New(&httplimit.Config{
		Decider: grantAll{},
		Policies: []httplimit.Policy{
			{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)},
			{Name: "perUser", Config: ratelimit.Config{Rate: 100, Period: time.Hour}, Key: httplimit.Header("X-User")},
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	h := m.Handler(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-User", "alice")
	b.ReportAllocs()
	for b.Loop() {
		h.ServeHTTP(httptest.NewRecorder(), r)
	}
}
