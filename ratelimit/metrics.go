package ratelimit

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/txlimit/txlimit/internal/observe"
)

// meterName is the name of the OpenTelemetry meter the Limiter takes from
// LimiterConfig.MeterProvider.
const meterName = "github.com/txlimit/txlimit/ratelimit"

// The names of the Limiter's instruments; LimiterConfig.MeterProvider says what each measures.
const (
	metricDecisions        = "txlimit.decisions"
	metricDecisionDuration = "txlimit.decision.duration"
	metricTxRetries        = "txlimit.tx.retries"
	metricBusy             = "txlimit.busy"
	metricBatchSize        = "txlimit.batch.size"
)

// durationBuckets are the bucket boundaries of txlimit.decision.duration, in seconds: 100 µs (a
// refusal on a near database) to 10 s (a call that waited for row locks). The SDK's default
// boundaries (0, 5, 10, 25, ...) are meant for milliseconds and would put every decision in one
// bucket. A View of the application's MeterProvider can replace them.
var durationBuckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// Outcomes recorded in the txlimit.outcome attribute.
const (
	outcomeGranted  = "granted"
	outcomeReserved = "reserved"
	outcomeDenied   = "denied"
	outcomeError    = "error"
)

// observer records a Limiter's metrics and logs. The zero of both (no MeterProvider, no Logger)
// costs a few no-op calls per decision.
type observer struct {
	log       *slog.Logger
	meter     *observe.Meter // meter.Given: a MeterProvider was given, record measurements
	decisions metric.Int64Counter
	duration  metric.Float64Histogram
	retries   metric.Int64Counter
	busyCount metric.Int64Counter
	batchSize metric.Int64Histogram
}

func newObserver(mp metric.MeterProvider, log *slog.Logger) *observer {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	o := &observer{log: log, meter: observe.New(mp, observe.NoOp, meterName)}
	m := o.meter
	var errs [5]error
	o.decisions, errs[0] = m.Int64Counter(metricDecisions, metric.WithUnit("{request}"),
		metric.WithDescription("Rate limit requests decided, by limit, call and outcome."))
	o.duration, errs[1] = m.Float64Histogram(metricDecisionDuration, metric.WithUnit("s"),
		metric.WithDescription("Duration of a rate limit call, by call and outcome."),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	o.retries, errs[2] = m.Int64Counter(metricTxRetries, metric.WithUnit("{retry}"),
		metric.WithDescription("Serializable transactions and Batcher batches run again after a serialization failure or deadlock."))
	o.busyCount, errs[3] = m.Int64Counter(metricBusy, metric.WithUnit("{decision}"),
		metric.WithDescription("Sharded decisions that found every candidate shard taken, by limit."))
	o.batchSize, errs[4] = m.Int64Histogram(metricBatchSize, metric.WithUnit("{call}"),
		metric.WithDescription("Calls decided together in one statement."))
	observe.Created(log, "ratelimit", errs[:]...)
	return o
}

// decided records one call: every request of it by outcome, and its duration. reqs are the call's
// requests (their names label the counts), res its result when err is nil.
func (o *observer) decided(ctx context.Context, op string, start time.Time, reqs []Request, res ManyResult, err error) {
	if o == nil {
		return
	}
	callOutcome := outcomeGranted
	switch {
	case err != nil:
		callOutcome = outcomeError
		errType := errorType(err)
		if o.meter.Given {
			for _, r := range reqs {
				name := r.Name
				if errType == "invalid" {
					name = "" // an invalid name is not a label
				}
				o.decisions.Add(ctx, 1, o.attrs(attrKey{op: op, limit: name, outcome: outcomeError, errType: errType}).Add...)
			}
		}
		if errType == "database" {
			o.log.WarnContext(ctx, "ratelimit: decision failed", "op", op, "error", err)
		}
	case !res.OK:
		callOutcome = outcomeDenied
	}
	if !o.meter.Given {
		return
	}
	if err == nil {
		for _, r := range res.Results {
			out := outcomeGranted
			switch {
			case !res.OK && !r.OK:
				out = outcomeDenied
			case !res.OK:
				continue // would have been granted, but the call was denied: counted under its denial
			case r.Reserved:
				out = outcomeReserved
			}
			o.decisions.Add(ctx, 1, o.attrs(attrKey{op: op, limit: r.Name, outcome: out}).Add...)
		}
	}
	o.duration.Record(ctx, time.Since(start).Seconds(), o.attrs(attrKey{op: op, outcome: callOutcome, call: true}).Record...)
}

// attrKey names one attribute set of a measurement: an empty field is not an attribute.
type attrKey struct {
	op, limit, outcome, errType string
	call                        bool // the set of a call's duration (no limit)
}

// attrs returns the measurement options of k's attributes, built once.
func (o *observer) attrs(k attrKey) observe.Options {
	return o.meter.Attrs(k, func() []attribute.KeyValue {
		kvs := []attribute.KeyValue{attribute.String("txlimit.op", k.op), attribute.String("txlimit.outcome", k.outcome)}
		if k.errType != "" {
			kvs = append(kvs, attribute.String("error.type", k.errType))
		}
		if !k.call && k.errType != "invalid" {
			kvs = append(kvs, attribute.String("txlimit.limit", k.limit))
		}
		return kvs
	})
}

// errorType names the kind of a call's error for the error.type attribute.
func errorType(err error) string {
	var busy *BusyError
	switch {
	case errors.Is(err, ErrInvalid):
		return "invalid"
	case errors.As(err, &busy):
		return "busy"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	case errors.Is(err, ErrBatcherClosed):
		return "closed" // nothing was sent to the database
	}
	return "database"
}

// busy records a sharded decision that found every candidate shard taken.
func (o *observer) busy(ctx context.Context, name string) {
	if o == nil || !o.meter.Given {
		return
	}
	o.busyCount.Add(ctx, 1, metric.WithAttributes(attribute.String("txlimit.limit", name)))
}

// retry records that InSerializableTx runs fn again, or a Batcher its batch (what: txWhat, or
// "batch of n calls"), after attempt failed with err.
func (o *observer) retry(ctx context.Context, what string, attempt int, err error) {
	if o == nil {
		return
	}
	o.retries.Add(ctx, 1)
	if what == txWhat {
		o.log.DebugContext(ctx, "ratelimit: serializable transaction retried", "attempt", attempt, "error", err)
	} else {
		o.log.DebugContext(ctx, "ratelimit: batch retried", "batch", what, "attempt", attempt, "error", err)
	}
}

// exhausted logs that InSerializableTx, or a Batcher's batch, gave up.
func (o *observer) exhausted(ctx context.Context, what string, attempts int, err error) {
	if o == nil {
		return
	}
	if what == txWhat {
		o.log.WarnContext(ctx, "ratelimit: serializable transaction retries exhausted", "attempts", attempts, "error", err)
	} else {
		o.log.WarnContext(ctx, "ratelimit: batch retries exhausted", "batch", what, "attempts", attempts, "error", err)
	}
}

// batch records that n calls were decided together in one statement. The batching front end calls
// it once per statement.
func (o *observer) batch(ctx context.Context, n int) {
	if o == nil {
		return
	}
	o.batchSize.Record(ctx, int64(n))
}
