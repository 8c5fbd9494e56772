package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrBatcherClosed is returned (errors.Is) by every call made to a Batcher after Close began,
// unless its input is bad (its typed error comes first) or its context has already ended
// (ctx.Err()). Nothing was sent to the database for such a call.
var ErrBatcherClosed = errors.New("ratelimit: batcher is closed")

// BatcherConfig configures a Batcher. A nil *BatcherConfig is the zero value: every default.
type BatcherConfig struct {
	// Lanes is the number of deciding lanes. Each lane decides one batch at a time on one
	// connection of the pool, acquired for the batch and released after it, so a Batcher holds at
	// most Lanes connections at once. A call on one (name, key) always goes to that key's lane, so
	// two batches of such calls never wait on each other's row locks. A LimitMany goes to the lane
	// of its smallest (name, key): with more than one lane it can meet a batch of another lane on
	// one of its other rows, and a request whose row sorts before one its batch already holds is
	// then refused with RetryAt = Time (retry at once: an under-grant, never an over-grant, as
	// docs/spec.md §7 says of lists). With one lane this cannot happen; with any number, a call
	// on a key that another transaction is creating (not yet committed) and that sorts before a
	// key alone in its batch whose row the batch has locked is refused so too. More lanes decide more
	// distinct keys in parallel, on
	// more database cores, and one lane's round trip and commit overlap another's; fewer lanes give
	// every key bigger batches, which cost the database less per decision. Must be 0 to 1024.
	// Defaults to 1 (see docs/design-history.md, "the Batcher keeps one lane by default", for how
	// it was chosen).
	Lanes int

	// MaxBatch is the most calls one lane decides in one statement. Must not be negative. Defaults
	// to 256.
	MaxBatch int

	// Retry bounds how a batch whose statement failed with a serialization failure (40001) or a
	// deadlock (40P01) is run again, whole, after a full-jitter backoff, exactly as InSerializableTx
	// retries a transaction; when attempts run out the batch's calls fail with a
	// *RetriesExhaustedError. Retry.Limiter, when set, counts the batches run again in its
	// txlimit.tx.retries and logs them (debug) and a give-up (warn), as for InSerializableTx.
	// Defaults to TxOpts' defaults: 10 attempts, 2 ms doubling to 200 ms, not counted. A negative
	// field is an *ArgumentError from NewBatcher.
	Retry TxOpts
}

// Batcher decides limits on a pool, batching concurrent calls: the Limiter's calls for decisions
// that are not part of a transaction of the caller's (a per-request API limit, a worker's global
// budget). Use the Limiter with a pgx.Tx when a decision must commit or roll back with your own
// writes.
//
// Calls go to a lane chosen by (name, key): a Limit, LimitN, Check or CheckN by its own name and
// key, a LimitMany or CheckMany by the smallest (name, key) of its requests (by name, then key,
// comparing bytes). When the lane is idle, a call is decided at once, on the caller's goroutine,
// as a batch of one: no latency is added at low load. While the lane is deciding,
// calls wait in its queue, and when it is free again it takes everything queued (up to
// BatcherConfig.MaxBatch) and decides it in one statement and one commit. There is no timer: a
// batch is whatever arrived while the previous one was being decided.
//
// Each call's result is exactly what it would have been had the calls of its batch run one by one,
// in the order they arrived; Result.Batched says how many calls shared the statement. Nothing is
// reported before the commit returned. Bad input is refused before a call is queued, with the
// same typed errors as the Limiter's, so it never fails the calls it would have been batched
// with. A batch that fails with 40001 or 40P01 is run again, whole, as BatcherConfig.Retry says;
// any other error fails every call of the batch with that error, and the Batcher goes on with the
// next batch. Such a batch granted nothing, unless the connection broke while its commit was under
// way: then, as for any commit whose answer was lost, it may have committed (an under-grant at
// worst, never an over-grant).
//
// Contexts: a call whose context ends while it waits in the queue is removed from the queue,
// returns ctx.Err() and is never charged. A call whose context ends while its batch is being
// decided returns ctx.Err() at once, but the batch goes on for the others, so its grant may stand:
// an under-grant (tokens charged for a call told it failed), never an over-grant. When every caller
// of a batch has gone (a batch of one included), its statement is cancelled; a grant it committed
// first stands. A call on an idle lane is decided on its caller's goroutine, so that caller returns
// once pgx has cancelled the statement; the callers of a batch on the lane's goroutine return at once.
//
// Panics: a panic while a batch is decided (LimiterConfig.Now, a pool's tracer) reaches every
// caller of the batch still waiting for it, each panicking with the same value on its own
// goroutine, as a Limiter's call would; the lane goes on deciding.
//
// A Batcher is safe for concurrent use. Close it to stop its goroutines (one per lane).
type Batcher struct {
	pool     *pgxpool.Pool
	lim      *Limiter
	lanes    []*lane
	maxBatch int
	retry    TxOpts
	retryObs *observer // Retry.Limiter's: counts and logs the batches run again
	seed     maphash.Seed
	wg       sync.WaitGroup
	close    sync.Once
	closing  atomic.Bool // Close began: calls are refused on every lane, marked closed or not yet

	// observe, when set (tests), sees the contexts of each batch in arrival order before it is decided.
	observe func(ctxs []context.Context)
}

// lane is one deciding lane: a queue and the goroutine that drains it.
type lane struct {
	mu     sync.Mutex
	wake   *sync.Cond
	queue  []*pending
	busy   bool // a batch is being decided: by the lane's goroutine, or by its only caller
	closed bool
}

// pending is one queued call.
type pending struct {
	ctx   context.Context
	c     *call
	taken bool          // guarded by the lane's mu: part of a batch being decided
	done  chan struct{} // closed when out, err and n are set, or panicked
	out   outcome
	err   error
	n     int
	// panicked: deciding the batch on the lane's goroutine panicked with panicVal, which the
	// caller's goroutine panics with in turn.
	panicked bool
	panicVal any
}

// NewBatcher returns a Batcher deciding the limits of lim on pool, with config's lanes and batch
// size (nil: the defaults). It starts one goroutine per lane; Close stops them. A nil pool or lim
// is an *ArgumentError.
func NewBatcher(pool *pgxpool.Pool, lim *Limiter, config *BatcherConfig) (*Batcher, error) {
	const op = "NewBatcher"
	if pool == nil {
		return nil, &ArgumentError{Op: op, Arg: "pool", Reason: "is nil: pass the *pgxpool.Pool to decide on"}
	}
	if lim == nil {
		return nil, &ArgumentError{Op: op, Arg: "lim", Reason: "is nil: pass the *Limiter whose limits to decide"}
	}
	var cfg BatcherConfig
	if config != nil {
		cfg = *config
	}
	if cfg.Lanes < 0 || cfg.Lanes > 1024 {
		return nil, &ArgumentError{Op: op, Arg: "config", Reason: fmt.Sprintf("Lanes must be 0 (the default) to 1024 (got %d)", cfg.Lanes)}
	}
	if cfg.MaxBatch < 0 {
		return nil, &ArgumentError{Op: op, Arg: "config", Reason: fmt.Sprintf("MaxBatch must be >= 0, 0 meaning the default (got %d)", cfg.MaxBatch)}
	}
	if r := cfg.Retry.negative("Retry."); r != "" {
		return nil, &ArgumentError{Op: op, Arg: "config", Reason: r}
	}
	if cfg.Lanes == 0 {
		cfg.Lanes = 1
	}
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = 256
	}
	b := &Batcher{pool: pool, lim: lim, maxBatch: cfg.MaxBatch, retry: retryDefaults(cfg.Retry), seed: maphash.MakeSeed()}
	if cfg.Retry.Limiter != nil {
		b.retryObs = cfg.Retry.Limiter.obs
	}
	b.lanes = make([]*lane, cfg.Lanes)
	for i := range b.lanes {
		ln := &lane{}
		ln.wake = sync.NewCond(&ln.mu)
		b.lanes[i] = ln
		b.wg.Add(1)
		go b.run(ln)
	}
	return b, nil
}

// Limit is Limiter.Limit decided in a batch on the pool. It is shorthand for
// LimitN(ctx, name, key, 1, opts).
func (b *Batcher) Limit(ctx context.Context, name, key string, opts *LimitOpts) (Result, error) {
	return b.single(ctx, "Limit", name, key, 1, opts, false)
}

// LimitN is Limiter.LimitN decided in a batch on the pool.
func (b *Batcher) LimitN(ctx context.Context, name, key string, count float64, opts *LimitOpts) (Result, error) {
	return b.single(ctx, "LimitN", name, key, count, opts, false)
}

// Check is Limiter.Check decided in a batch on the pool. It is shorthand for
// CheckN(ctx, name, key, 1, opts).
func (b *Batcher) Check(ctx context.Context, name, key string, opts *LimitOpts) (Result, error) {
	return b.single(ctx, "Check", name, key, 1, opts, true)
}

// CheckN is Limiter.CheckN decided in a batch on the pool: it consumes nothing.
func (b *Batcher) CheckN(ctx context.Context, name, key string, count float64, opts *LimitOpts) (Result, error) {
	return b.single(ctx, "CheckN", name, key, count, opts, true)
}

// LimitMany is Limiter.LimitMany decided in a batch on the pool: every request or none.
func (b *Batcher) LimitMany(ctx context.Context, reqs []Request, opts *LimitOpts) (ManyResult, error) {
	return b.many(ctx, "LimitMany", reqs, false, false, opts)
}

// CheckMany is Limiter.CheckMany decided in a batch on the pool: it consumes nothing.
func (b *Batcher) CheckMany(ctx context.Context, reqs []Request, opts *LimitOpts) (ManyResult, error) {
	return b.many(ctx, "CheckMany", reqs, false, true, opts)
}

func (b *Batcher) single(ctx context.Context, op, name, key string, count float64, opts *LimitOpts, dry bool) (Result, error) {
	return firstResult(b.many(ctx, op, singleRequest(name, key, count, opts), true, dry, opts))
}

// many is Limiter.many with the statement on the lane of the call's smallest (name, key).
func (b *Batcher) many(ctx context.Context, op string, reqs []Request, single, dry bool, opts *LimitOpts) (ManyResult, error) {
	return b.lim.decide(ctx, op, reqs, single, dry, opts, func(c *call) (ManyResult, error) {
		name, key := reqs[0].Name, reqs[0].Key
		for _, r := range reqs[1:] {
			if r.Name < name || (r.Name == name && r.Key < key) {
				name, key = r.Name, r.Key
			}
		}
		return b.submit(ctx, c, name, key)
	})
}

// laneOf returns the lane of (name, key).
func (b *Batcher) laneOf(name, key string) *lane {
	if len(b.lanes) == 1 {
		return b.lanes[0]
	}
	var h maphash.Hash
	h.SetSeed(b.seed)
	h.WriteString(name)
	h.WriteByte(0) // names hold no NUL: (name, key) pairs hash apart
	h.WriteString(key)
	return b.lanes[h.Sum64()%uint64(len(b.lanes))]
}

// submit queues c on the lane of (name, key) and waits for its outcome or for ctx to end.
func (b *Batcher) submit(ctx context.Context, c *call, name, key string) (ManyResult, error) {
	if err := ctx.Err(); err != nil {
		return ManyResult{}, err
	}
	ln := b.laneOf(name, key)
	p := &pending{ctx: ctx, c: c, done: make(chan struct{})}
	ln.mu.Lock()
	if ln.closed || b.closing.Load() {
		ln.mu.Unlock()
		return ManyResult{}, fmt.Errorf("ratelimit: %s: %w", c.op, ErrBatcherClosed)
	}
	if !ln.busy && len(ln.queue) == 0 {
		// The lane is idle: the caller decides its call at once, on its own goroutine, as a batch
		// of one (no hand-over to the lane's goroutine and back). Calls arriving meanwhile queue,
		// and the lane's goroutine takes them when this one is done.
		ln.busy, p.taken = true, true
		ln.mu.Unlock()
		b.decideInline(ln, p)
		return p.outcome(ctx)
	}
	ln.queue = append(ln.queue, p)
	ln.wake.Signal()
	ln.mu.Unlock()

	select {
	case <-p.done:
	case <-ctx.Done():
		ln.mu.Lock()
		if !p.taken {
			// Still queued: out of the queue, never decided, never charged.
			for i, q := range ln.queue {
				if q == p {
					ln.queue = append(ln.queue[:i], ln.queue[i+1:]...)
					break
				}
			}
			ln.mu.Unlock()
			return ManyResult{}, ctx.Err()
		}
		ln.mu.Unlock()
		select {
		case <-p.done: // decided meanwhile: the result is there, give it
		default:
			return ManyResult{}, ctx.Err() // in flight: the batch goes on without this caller
		}
	}
	return p.outcome(ctx)
}

// decideInline decides p, a batch of one, on its caller's goroutine, and frees ln (busy) after it,
// also when deciding panics (LimiterConfig.Now, a pool's tracer): the panic goes on to the caller,
// as on the Limiter, and the lane goes on deciding.
func (b *Batcher) decideInline(ln *lane, p *pending) {
	defer func() {
		ln.mu.Lock()
		ln.busy = false
		if len(ln.queue) > 0 || ln.closed {
			ln.wake.Signal() // only then: waking the lane's goroutine for nothing costs a caller alone
		}
		ln.mu.Unlock()
	}()
	b.decide([]*pending{p})
}

// decideOnLane decides batch on the lane's goroutine. A panic while deciding it (LimiterConfig.Now,
// a pool's tracer) cannot be recovered by anyone on this goroutine and would end the process: it
// goes instead to the batch's callers, each panicking with the same value on its own goroutine (as
// on the Limiter, and as for a call decided on its caller's goroutine), and the lane goes on. A
// caller that left before the panic (its context ended) has returned ctx.Err() and never sees it.
func (b *Batcher) decideOnLane(batch []*pending) {
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		for _, p := range batch {
			select {
			case <-p.done: // given its outcome before the panic
			default:
				p.panicked, p.panicVal = true, v
				close(p.done)
			}
		}
	}()
	b.decide(batch)
}

// outcome is the decided call's outcome for a caller whose context is ctx: when its batch failed
// after ctx ended, the caller's own ctx.Err() (the batch's statement was cancelled because its
// callers, this one among them, had left), else result.
func (p *pending) outcome(ctx context.Context) (ManyResult, error) {
	if p.panicked {
		panic(p.panicVal)
	}
	if p.err != nil && ctx.Err() != nil {
		return ManyResult{}, ctx.Err()
	}
	return p.result()
}

// result is the decided call's outcome, with Batched set.
func (p *pending) result() (ManyResult, error) {
	if p.err != nil {
		return ManyResult{}, p.err
	}
	if p.out.err != nil {
		return ManyResult{}, p.out.err
	}
	m := p.out.res
	m.Batched = p.n
	for i := range m.Results {
		m.Results[i].Batched = p.n
	}
	return m, nil
}

// run is a lane's goroutine: it decides what is queued, batch after batch, until Close and an
// empty queue.
func (b *Batcher) run(ln *lane) {
	defer b.wg.Done()
	for {
		ln.mu.Lock()
		for (len(ln.queue) == 0 && !ln.closed) || ln.busy {
			ln.wake.Wait()
		}
		if len(ln.queue) == 0 {
			ln.mu.Unlock() // closed, nothing queued, nothing in flight
			return
		}
		// Taking a call out of the queue under ln.mu is what makes it in flight: one whose context
		// has ended by then is left out (its caller, woken by ctx, finds it not taken and returns
		// ctx.Err()), so a call cancelled while queued is never charged.
		n := min(len(ln.queue), b.maxBatch)
		batch := make([]*pending, 0, n)
		for _, p := range ln.queue[:n] {
			if p.ctx.Err() == nil {
				p.taken = true
				batch = append(batch, p)
			}
		}
		rest := copy(ln.queue, ln.queue[n:])
		clear(ln.queue[rest:])
		ln.queue = ln.queue[:rest]
		if len(batch) == 0 {
			ln.mu.Unlock()
			continue
		}
		ln.busy = true
		ln.mu.Unlock()
		b.decideOnLane(batch)
		ln.mu.Lock()
		ln.busy = false
		ln.mu.Unlock()
	}
}

// decide decides one batch and hands every caller its outcome.
func (b *Batcher) decide(batch []*pending) {
	calls := make([]*call, len(batch))
	for i, p := range batch {
		calls[i] = p.c
	}
	if b.observe != nil {
		ctxs := make([]context.Context, len(batch))
		for i, p := range batch {
			ctxs[i] = p.ctx
		}
		b.observe(ctxs)
	}

	// The statement is not the callers': one caller leaving does not cancel it for the others.
	// When every caller has left (and each could), nobody waits for it, so it is cancelled. For a
	// batch of one that is the caller's own context.
	ctx := batch[0].ctx
	if len(batch) > 1 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(context.Background())
		defer cancel()
		var waiting atomic.Int64
		waiting.Store(int64(len(batch)))
		for _, p := range batch {
			if p.ctx.Done() == nil {
				continue // this caller can never leave
			}
			stop := context.AfterFunc(p.ctx, func() {
				if waiting.Add(-1) == 0 {
					cancel()
				}
			})
			defer stop()
		}
	}

	b.lim.obs.batch(ctx, len(batch))
	outs, err := b.decideRetrying(ctx, calls)
	for i, p := range batch {
		if err != nil {
			p.err = callError(err, p.c.op)
		} else {
			p.out = outs[i]
		}
		p.n = len(batch)
		close(p.done)
	}
}

// callError is a batch's error err as the batch's call of op returns it: an *ArgumentError
// (LimiterConfig.Now out of bounds, read once for the whole statement) names that call, as the
// Limiter's would, not the batch's first.
func callError(err error, op string) error {
	if arg, ok := err.(*ArgumentError); ok && arg.Op != op {
		e := *arg
		e.Op = op
		return &e
	}
	return err
}

// decideRetrying decides calls, running them again whole after a serialization failure or a
// deadlock, as b.retry bounds (the loop of InSerializableTx).
func (b *Batcher) decideRetrying(ctx context.Context, calls []*call) ([]outcome, error) {
	var outs []outcome
	err := retrying(ctx, b.retry, b.retryObs, fmt.Sprintf("batch of %d calls", len(calls)), func() error {
		var err error
		outs, err = b.decideOnce(ctx, calls)
		return err
	}, nil)
	if err != nil {
		return nil, err
	}
	return outs, nil
}

// decideOnce decides calls on one connection of the pool, in one autocommit statement.
//
// The connection is acquired per batch rather than held by the lane: holding it measured no
// faster (BenchmarkBatcher, 16 callers: within the run-to-run noise of this machine), and a
// connection back in the pool is health-checked by it and can serve others while the lane idles.
func (b *Batcher) decideOnce(ctx context.Context, calls []*call) ([]outcome, error) {
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("ratelimit: batch: acquire a connection: %w", err)
	}
	defer conn.Release() // a broken connection goes back to be destroyed
	// One statement in autocommit: one durable commit for the whole batch, and nothing of it is
	// written when it fails (so a retried batch charges nothing twice).
	outs, err := b.lim.decideCalls(ctx, conn, calls)
	if err != nil {
		return nil, dbError(ctx, conn, "Batcher", err)
	}
	return outs, nil
}

// Close stops the Batcher: calls made from now on return ErrBatcherClosed, calls already queued
// or being decided are decided, and Close returns once every lane's goroutine has ended. It may be
// called more than once.
func (b *Batcher) Close() {
	b.closing.Store(true)
	b.close.Do(func() {
		for _, ln := range b.lanes {
			ln.mu.Lock()
			ln.closed = true
			ln.wake.Broadcast()
			ln.mu.Unlock()
		}
	})
	b.wg.Wait()
}
