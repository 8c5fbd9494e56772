// Command httpserver is a small JSON API rate-limited with txlimit:
//
//   - GET /api/items is guarded by the httplimit middleware: per client IP AND per user, decided
//     together, all or nothing;
//   - POST /api/messages limits and writes the message inside its own transaction, then reports the
//     limit with the same header fields (Middleware.WriteHeaders / WriteDenied);
//   - GET /metrics serves the Limiter's and the middleware's metrics through the OpenTelemetry
//     Prometheus exporter.
//
// The user is whoever "Authorization: Bearer <name>" names (a stand-in for real authentication).
//
// With -demo (as make demo runs it) it starts on a free loopback port, sends requests with a real
// HTTP client, prints the statuses, header fields and bodies, and a few metric lines, and stops.
// Without it, it serves on -addr until interrupted.
//
// It connects to DATABASE_URL and migrates the first schema of its search_path, as an application
// does at start-up: make demo sets DATABASE_URL to a fresh schema, dropped at the end (by hand,
// name an empty one: …?search_path=httpserver). It imports only public packages, so it can be
// copied into an application.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/migrations"
	"github.com/txlimit/txlimit/ratelimit"
)

// The limits. sendMessage is decided by its handler, the others by the middleware.
var (
	perIP       = ratelimit.Config{Rate: 60, Period: time.Minute, Capacity: 10}
	perUser     = ratelimit.Config{Rate: 3, Period: time.Minute}
	sendMessage = ratelimit.Config{Rate: 2, Period: time.Minute}
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "address to serve on (without -demo)")
	demo := flag.Bool("demo", false, "serve on a free loopback port, send requests, print what happened, stop")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *addr, *demo); err != nil {
		log.Fatalf("httpserver: %v", err)
	}
}

func run(ctx context.Context, addr string, demo bool) error {
	fmt.Println("# httpserver: an HTTP API limited per client IP and per user, and in a handler's transaction")
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		return errors.New("DATABASE_URL is not set: set it to a Postgres URL, or run make demo, which finds or starts a Postgres")
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE messages (id bigserial PRIMARY KEY, user_id text NOT NULL, body text NOT NULL)"); err != nil {
		return fmt.Errorf("create the table messages: %w (DATABASE_URL must lead to an empty schema: set its search_path to a new one, or drop this one's tables)", err)
	}

	// Metrics: one MeterProvider for the Limiter and the middleware, read by Prometheus.
	registry := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry), otelprom.WithoutScopeInfo())
	if err != nil {
		return err
	}
	meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	defer func() { _ = meters.Shutdown(context.Background()) }()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	limiter, err := ratelimit.New(&ratelimit.LimiterConfig{
		Limits:        map[string]ratelimit.Config{"sendMessage": sendMessage},
		Logger:        logger,
		MeterProvider: meters,
	})
	if err != nil {
		return err
	}
	secret := os.Getenv("HTTPSERVER_SECRET") // the same on every replica, so clients see one pk
	if secret == "" {
		secret = "demo secret: set HTTPSERVER_SECRET"
	}
	batcher, err := ratelimit.NewBatcher(pool, limiter, nil)
	if err != nil {
		return err
	}
	defer batcher.Close()
	mw, err := httplimit.New(&httplimit.Config{
		Decider:       batcher,
		Logger:        logger,
		MeterProvider: meters,
		Policies: []httplimit.Policy{
			{Name: "perIP", Config: perIP, Key: httplimit.ClientIP(nil)},
			{Name: "perUser", Config: perUser, Key: bearer},
			{Name: "sendMessage", Config: sendMessage}, // no Key: decided by the handler
		},
		RetryJitter: 3 * time.Second,
		Secret:      []byte(secret),
	})
	if err != nil {
		return err
	}

	mux := http.NewServeMux()
	mux.Handle("GET /api/items", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, _ := bearer(r)
		writeJSON(w, http.StatusOK, map[string]any{"user": user, "items": []string{"apple", "pear"}})
	})))
	mux.HandleFunc("POST /api/messages", func(w http.ResponseWriter, r *http.Request) {
		postMessage(w, r, pool, limiter, mw)
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))

	if !demo {
		srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() {
			<-ctx.Done()
			_ = srv.Shutdown(context.Background())
		}()
		fmt.Printf("serving on http://%s (GET /api/items, POST /api/messages, GET /metrics)\n", addr)
		if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer func() { _ = srv.Shutdown(context.Background()) }()
	return client(ctx, "http://"+ln.Addr().String())
}

// bearer is the perUser key: the name in "Authorization: Bearer <name>".
func bearer(r *http.Request) (string, error) {
	name, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || strings.TrimSpace(name) == "" {
		return "", httplimit.ErrNoKey
	}
	return strings.TrimSpace(name), nil
}

// postMessage limits and inserts in one transaction: the message and the token it costs commit
// together, or neither does.
func postMessage(w http.ResponseWriter, r *http.Request, pool *pgxpool.Pool, limiter *ratelimit.Limiter, mw *httplimit.Middleware) {
	ctx := r.Context()
	user, err := bearer(r)
	if err != nil {
		writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "send Authorization: Bearer <name>"})
		return
	}
	var msg struct {
		Body string `json:"body"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&msg); err != nil || msg.Body == "" {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": `send {"body": "..."}`})
		return
	}
	var res ratelimit.Result
	var id int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		if res, err = limiter.Limit(ctx, tx, "sendMessage", user, nil); err != nil {
			return err
		}
		if err := res.Err(); err != nil {
			return err // nothing to roll back but the transaction itself
		}
		return tx.QueryRow(ctx, "INSERT INTO messages (user_id, body) VALUES ($1, $2) RETURNING id", user, msg.Body).Scan(&id)
	})
	switch {
	case ratelimit.IsLimited(err):
		mw.WriteDenied(w, res)
	case errors.Is(err, ratelimit.ErrInvalid):
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
	case err != nil:
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "try again later"})
	default:
		mw.WriteHeaders(w, res)
		writeJSON(w, http.StatusCreated, map[string]any{"id": id, "user": user})
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// client is the demo: a real HTTP client against the server at base.
func client(ctx context.Context, base string) error {
	c := &http.Client{Timeout: 10 * time.Second}
	do := func(method, path, user, body string) error {
		req, err := http.NewRequestWithContext(ctx, method, base+path, strings.NewReader(body))
		if err != nil {
			return err
		}
		if user != "" {
			req.Header.Set("Authorization", "Bearer "+user)
		}
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		fmt.Printf("%s %s as %s -> %s\n", method, path, user, resp.Status)
		for _, h := range []string{"RateLimit-Policy", "RateLimit", "Retry-After", "Content-Type"} {
			if v := resp.Header.Get(h); v != "" && (h != "Content-Type" || resp.StatusCode >= 400) {
				fmt.Printf("  %s: %s\n", h, v)
			}
		}
		fmt.Printf("  %s\n", strings.TrimSpace(string(b)))
		return nil
	}
	fmt.Printf("serving on %s; a real HTTP client sends the requests\n", base)
	fmt.Printf("\n== GET /api/items: perIP (%s) AND perUser (%s), decided together by the middleware\n", perIP, perUser)
	for range 4 {
		if err := do("GET", "/api/items", "alice", ""); err != nil {
			return err
		}
	}
	if err := do("GET", "/api/items", "bob", ""); err != nil {
		return err
	}
	fmt.Printf("\n== POST /api/messages: sendMessage (%s), decided in the handler's transaction\n", sendMessage)
	for i := 1; i <= 3; i++ {
		if err := do("POST", "/api/messages", "carol", fmt.Sprintf(`{"body": "hello #%d"}`, i)); err != nil {
			return err
		}
	}

	fmt.Println("\n== GET /metrics (the txlimit series)")
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "txlimit_") && !strings.Contains(line, "_bucket{") {
			fmt.Println(line)
		}
	}
	return sc.Err()
}
