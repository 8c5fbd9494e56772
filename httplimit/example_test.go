package httplimit_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/internal/testdb"
	"github.com/txlimit/txlimit/ratelimit"
)

// Per IP and per user, decided together: a request denied by one consumes nothing of the other.
func Example_middleware() {
	// In an application: pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")), then
	// migrations.Up(ctx, pool) once at start-up. The examples get a fresh migrated schema.
	pool, done := testdb.ForExample()
	defer done()
	// Now pins the clock so that the output below is exact; leave it nil in production (the
	// database's clock).
	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{Now: func() time.Time { return time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC) }})
	if err != nil {
		panic(err)
	}

	// example:begin
	// The Batcher decides concurrent requests together: one statement and one commit per batch.
	batcher, err := ratelimit.NewBatcher(pool, limiter, nil)
	if err != nil {
		panic(err)
	}
	defer batcher.Close()
	// Behind a reverse proxy on 10.0.0.0/8 that appends to X-Forwarded-For: its requests are keyed
	// by the right-most address it wrote there, any other peer's by its own address.
	clientIP := httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	mw, err := httplimit.New(&httplimit.Config{
		Decider: batcher,
		Policies: []httplimit.Policy{
			{Name: "perIP", Config: ratelimit.Config{Rate: 10, Period: time.Minute, Capacity: 3}, Key: clientIP},
			{Name: "perUser", Config: ratelimit.Config{Rate: 100, Period: time.Hour}, Key: httplimit.Header("X-User"), MissingKey: httplimit.MissingKeySkip},
		},
		Secret: []byte("the same secret on every replica"), // keys the pk hashes
	})
	if err != nil {
		panic(err)
	}
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"items":[]}`)
	})
	mux := http.NewServeMux()
	mux.Handle("GET /items", mw.Handler(api))
	// example:end

	srv := httptest.NewServer(mux)
	defer srv.Close()
	for i := 1; i <= 4; i++ {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/items", nil)
		req.Header.Set("X-User", "alice")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.Status, "RateLimit:", resp.Header.Get("RateLimit"))
		if resp.StatusCode == http.StatusTooManyRequests {
			fmt.Println("Retry-After:", resp.Header.Get("Retry-After"))
			fmt.Println(strings.TrimSpace(string(body)))
		}
	}
	// Output:
	// 200 OK RateLimit: "perIP";r=2;t=6;pk=:Mp2Xm4OVFN3xSG7B:, "perUser";r=99;t=36;pk=:67DdcCOZqN4rT/zQ:
	// 200 OK RateLimit: "perIP";r=1;t=6;pk=:Mp2Xm4OVFN3xSG7B:, "perUser";r=98;t=36;pk=:67DdcCOZqN4rT/zQ:
	// 200 OK RateLimit: "perIP";r=0;t=6;pk=:Mp2Xm4OVFN3xSG7B:, "perUser";r=97;t=36;pk=:67DdcCOZqN4rT/zQ:
	// 429 Too Many Requests RateLimit: "perIP";r=0;t=6;pk=:Mp2Xm4OVFN3xSG7B:, "perUser";r=96;t=36;pk=:67DdcCOZqN4rT/zQ:
	// Retry-After: 6
	// {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":429,"violated-policies":["perIP"]}
}

// The README quotes Example_middleware; this keeps the quote identical to the code that runs.
func TestReadmeQuotesTheMiddlewareExample(t *testing.T) {
	testdb.RequireReadmeQuote(t, "../README.md", "httplimit", "example_test.go", "Example_middleware")
}
