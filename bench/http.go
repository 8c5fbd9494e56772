package main

// The HTTP cell: a trivial handler on loopback, 64 keep-alive clients, served (a) with
// no limiter, (b) behind httplimit and (c) behind a middleware built on go-redis/redis_rate, one
// after another in one run. Every client has a key of its own and the limit is generous, so every
// request is decided and granted: the cell measures what deciding costs per request.

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/ratelimit"
)

// httpClients is the number of concurrent keep-alive clients of the HTTP cell.
const httpClients = 64

// httpRate is the limit of (b) and (c): per client, far more than a client can send, so that every
// request is granted.
const httpRate = 1_000_000

// HTTPResult is one server of the HTTP cell.
type HTTPResult struct {
	Name     string
	What     string
	Requests int64 // answered with 200
	Other    int64 // answered with another status, or failed
	FirstErr string
	Elapsed  time.Duration
	P50, P99 time.Duration
	CPU      CPUUse // the processor time of the timed part (cpu.go)
	Skipped  string // why the server did not run; empty when it did
	server   string // the database's process name ("" for none)
}

// PerSecond is the throughput in requests per second.
func (r *HTTPResult) PerSecond() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Requests) / r.Elapsed.Seconds()
}

// RunHTTP runs the three servers of the HTTP cell, each for d after a warm-up of one request per
// client.
func RunHTTP(ctx context.Context, env *Env, d time.Duration) ([]*HTTPResult, error) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	key := func(r *http.Request) (string, error) { return r.Header.Get("X-Client"), nil }

	limiter, err := ratelimit.New(nil)
	if err != nil {
		return nil, err
	}
	batcher, err := ratelimit.NewBatcher(env.Pool, limiter, env.Batcher)
	if err != nil {
		return nil, err
	}
	defer batcher.Close()
	mw, err := httplimit.New(&httplimit.Config{
		Decider: batcher,
		Policies: []httplimit.Policy{{Name: "http", Key: key,
			Config: ratelimit.Config{Rate: httpRate, Period: time.Second}}},
	})
	if err != nil {
		return nil, err
	}
	out := []*HTTPResult{
		runHTTPServer(ctx, env, "no limiter", "the handler alone", "", ok, d),
		runHTTPServer(ctx, env, "httplimit (batched)", "httplimit.Middleware deciding through a ratelimit.Batcher on the pool, RateLimit fields on every response", serverPostgres, mw.Handler(ok), d),
	}
	redisRes := &HTTPResult{Name: "redis_rate", What: "go-redis/redis_rate v10 (GCRA in a Lua script), RateLimit-style headers on every response"}
	if env.Redis == nil {
		redisRes.Skipped = fmt.Sprint(env.RedisErr)
	} else {
		rl := redis_rate.NewLimiter(env.Redis)
		limit := redis_rate.Limit{Rate: httpRate, Burst: httpRate, Period: time.Second}
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			res, err := rl.Allow(r.Context(), env.RedisPrefix+"http:"+r.Header.Get("X-Client"), limit)
			if err != nil {
				http.Error(w, "rate limit unavailable", http.StatusServiceUnavailable)
				return
			}
			w.Header().Set("RateLimit", "\"http\";r="+strconv.Itoa(res.Remaining)+";t="+strconv.Itoa(int((res.ResetAfter+time.Second-1)/time.Second)))
			if res.Allowed == 0 {
				w.Header().Set("Retry-After", strconv.Itoa(int((res.RetryAfter+time.Second-1)/time.Second)))
				http.Error(w, "too many requests", http.StatusTooManyRequests)
				return
			}
			ok.ServeHTTP(w, r)
		})
		redisRes = runHTTPServer(ctx, env, redisRes.Name, redisRes.What, serverRedis, h, d)
	}
	out = append(out, redisRes)
	for _, r := range out {
		if r.Skipped != "" {
			fmt.Fprintf(os.Stderr, "[http] %-18s skipped: %s\n", r.Name, r.Skipped)
			continue
		}
		self, srv, idle := r.CPU.columns(r.Requests, r.Elapsed.Seconds(), r.server != "")
		fmt.Fprintf(os.Stderr, "[http] %-18s %2d clients %9.0f req/s  p50 %8s  p99 %8s  CPU µs/request %s + %s, idle CPUs %s  (%d in %s, other %d%s)\n",
			r.Name, httpClients, r.PerSecond(), r.P50, r.P99, self, srv, idle,
			r.Requests, r.Elapsed.Round(time.Millisecond), r.Other, r.FirstErr)
	}
	return out, nil
}

// runHTTPServer serves h on a loopback port and has httpClients keep-alive clients call it for d.
// server names the processes of the database h decides on ("" for none), for the CPU figures.
func runHTTPServer(ctx context.Context, env *Env, name, what, server string, h http.Handler, d time.Duration) *HTTPResult {
	res := &HTTPResult{Name: name, What: what, server: server}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		res.Skipped = err.Error()
		return res
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer func() { _ = srv.Shutdown(context.Background()) }()
	url := "http://" + ln.Addr().String() + "/"
	tr := &http.Transport{MaxIdleConns: httpClients, MaxIdleConnsPerHost: httpClients, MaxConnsPerHost: httpClients}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	tag := strings.ReplaceAll(name, " ", "-")

	var other atomic.Int64
	var firstErr atomic.Value
	call := func(key string) (time.Duration, bool) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		req.Header.Set("X-Client", key)
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			firstErr.CompareAndSwap(nil, err.Error())
			return 0, false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			firstErr.CompareAndSwap(nil, resp.Status)
			return 0, false
		}
		return time.Since(start), true
	}

	// Warm-up: one request per client opens the connections (and creates the limit rows).
	var wg sync.WaitGroup
	for i := range httpClients {
		wg.Go(func() { call(fmt.Sprintf("%s-%d", tag, i)) })
	}
	wg.Wait()

	lat := make([][]time.Duration, httpClients)
	cpu0 := readCPU(env.ServerPIDs)
	start := time.Now()
	deadline := start.Add(d)
	for i := range httpClients {
		wg.Go(func() {
			key := fmt.Sprintf("%s-%d", tag, i)
			for n := 0; n < maxPerCaller && time.Now().Before(deadline) && ctx.Err() == nil; n++ {
				if l, ok := call(key); ok {
					lat[i] = append(lat[i], l)
				} else {
					other.Add(1)
				}
			}
		})
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	res.CPU = cpuSince(cpu0, env.ServerPIDs, server)
	all := slices.Concat(lat...)
	slices.Sort(all)
	res.Requests = int64(len(all))
	res.Other = other.Load()
	if v, ok := firstErr.Load().(string); ok {
		res.FirstErr = ", first: " + v
	}
	if len(all) > 0 {
		res.P50 = all[len(all)/2].Round(time.Microsecond)
		res.P99 = all[len(all)*99/100].Round(time.Microsecond)
	}
	return res
}

// httpMarkdown is the report's section on the HTTP cell.
func httpMarkdown(results []*HTTPResult) string {
	if len(results) == 0 {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n## HTTP: a trivial handler behind each limiter\n\n")
	fmt.Fprintf(&b, "%d keep-alive clients on loopback, each with a key of its own and a limit it never reaches (every request decided and granted), one server after another in this run.\n\n", httpClients)
	fmt.Fprintf(&b, "| server | how it limits | requests/s | p50 | p99 | non-200 | CPU µs/request: this process | CPU µs/request: database | idle CPUs |\n|---|---|--:|--:|--:|--:|--:|--:|--:|\n")
	byName := map[string]*HTTPResult{}
	for _, r := range results {
		byName[r.Name] = r
		if r.Skipped != "" {
			fmt.Fprintf(&b, "| %s | %s | skipped: %s | | | | | | |\n", r.Name, r.What, r.Skipped)
			continue
		}
		self, srv, idle := r.CPU.columns(r.Requests, r.Elapsed.Seconds(), r.server != "")
		fmt.Fprintf(&b, "| %s | %s | %.0f | %s | %s | %d | %s | %s | %s |\n", r.Name, r.What, r.PerSecond(), r.P50, r.P99, r.Other,
			self, srv, idle)
	}
	fmt.Fprintf(&b, "\nCPU columns as in the section on CPU per decision: this process (here the HTTP clients, the HTTP server, the middleware and the database client together) and the database's processes, per request answered with 200, and the CPUs left idle.\n")
	ratio := func(a, c string) string {
		x, y := byName[a], byName[c]
		if x == nil || y == nil || x.Skipped != "" || y.Skipped != "" || y.PerSecond() == 0 {
			return "n/a"
		}
		return fmt.Sprintf("%.3f×", x.PerSecond()/y.PerSecond())
	}
	fmt.Fprintf(&b, "\nhttplimit / redis_rate: **%s**; httplimit / no limiter: **%s**.\n",
		ratio("httplimit (batched)", "redis_rate"), ratio("httplimit (batched)", "no limiter"))
	return b.String()
}
