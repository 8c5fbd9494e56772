package httplimit

import (
	"context"
	"log/slog"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/txlimit/txlimit/internal/observe"
	"github.com/txlimit/txlimit/ratelimit"
)

// meterName is the name of the OpenTelemetry meter the middleware takes from
// Config.MeterProvider.
const meterName = "github.com/txlimit/txlimit/httplimit"

// metricRequests is the name of the middleware's counter; Config.MeterProvider says what it counts.
const metricRequests = "txlimit.http.requests"

const (
	outcomeGranted      = "granted"
	outcomeDenied       = "denied"
	outcomeShadowDenied = "shadow_denied"
	outcomeFailOpen     = "fail_open"
	outcomeError        = "error"
	outcomeCanceled     = "canceled"
	outcomeInvalid      = "invalid"
	outcomeNoKey        = "no_key"
	outcomeSkipped      = "skipped"
)

// observer counts and logs what the middleware does. With no MeterProvider it counts through the
// global one, with no Logger it logs to slog.Default(): failures are never silent by default.
type observer struct {
	log      *slog.Logger // nil: slog.Default() (logger)
	meter    *observe.Meter
	requests metric.Int64Counter
}

func newObserver(mp metric.MeterProvider, log *slog.Logger) *observer {
	o := &observer{log: log, meter: observe.New(mp, observe.Global, meterName)}
	var err error
	o.requests, err = o.meter.Int64Counter(metricRequests, metric.WithUnit("{request}"),
		metric.WithDescription("HTTP requests by rate limit policy and outcome."))
	observe.Created(o.logger(), "httplimit", err)
	return o
}

// logger is Config.Logger, or slog.Default() as it is now (the application may set it after New).
func (o *observer) logger() *slog.Logger {
	if o.log != nil {
		return o.log
	}
	return slog.Default()
}

// count adds one request with outcome to each policy.
func (o *observer) count(ctx context.Context, policies []*Policy, outcome string) {
	for _, p := range policies {
		o.add(ctx, p.Name, outcome)
	}
}

// countDenied adds one request with outcome to each denied policy of results.
func (o *observer) countDenied(ctx context.Context, results []ratelimit.Result, outcome string) {
	for _, r := range results {
		if !r.OK {
			o.add(ctx, r.Name, outcome)
		}
	}
}

// add counts one request of policy with outcome. The attribute sets are built once each: there
// are as many as policies (configured) times outcomes; passing them allocates nothing, not even
// when the provider records nothing (the global one before the application sets it).
func (o *observer) add(ctx context.Context, policy, outcome string) {
	o.requests.Add(ctx, 1, o.meter.Attrs([2]string{policy, outcome}, func() []attribute.KeyValue {
		return []attribute.KeyValue{attribute.String("txlimit.policy", policy), attribute.String("txlimit.outcome", outcome)}
	}).Add...)
}
