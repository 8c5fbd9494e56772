package ratelimit

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// admission keeps the lone calls that one Limiter runs on a pool (poolOf) for one key of a sharded
// limit from outnumbering the key's shards in Postgres. Steering already lets one transaction at a
// time decide on a shard (txlimit_steer): a caller beyond the shards can only wait there, on a
// backend of its own, for a candidate's advisory lock, plan again after it, and burn the
// processors the deciding calls need (docs/sharding.md, "Throughput", measured it). Here it waits
// in this process instead, for a free slot of the key, where waiting costs nothing.
//
// The slots are a hint, never a guard, as the advisory locks are: the engine decides exactly as it
// does without them, and a wait for a slot lasts admitWait at the most, after which the call goes
// on without one. So a slot held by a call that waits in Postgres for a row that the waiting
// caller's own open transaction holds (a caller mixing its transaction and the pool on one key)
// delays the caller, never deadlocks it. Only calls on a pool take slots: a call in the caller's
// transaction may hold rows another call needs, and a *pgx.Conn serves one call at a time.
//
// A refusal waits for no steering lock nor for anything else in Postgres, so a flood of refused calls
// on one key is answered in parallel there (docs/spec.md §7). To keep it so, a key whose call was
// just refused lets the calls that come after it through without a slot, for as long as the
// refusal's RetryAt is ahead and admitWait at the most; the next call after that takes a slot
// again and, refused too, opens the key again. The opening is for the calls the refusal speaks
// for, those refused as surely as it was: of its count or more, and reservations only when it was
// a reservation (a reservation may owe what a plain call may not take). A call of fewer tokens, or
// a reservation after a plain call's refusal, may be granted, and takes a slot as ever.
type admission struct {
	mu   sync.Mutex
	keys map[admissionKey]*admitted // the keys with a call in flight or waiting
	wait time.Duration              // the bound of a wait, and of a refusal's opening; 0: admitWait (tests change it)
}

// admissionKey is a key of one pool: the same name and key on another pool (another database or
// schema, perhaps) is another key, as it is to the steering locks, which are the state table's.
type admissionKey struct {
	db        any // poolOf's value: the *pgxpool.Pool, or the *sql.DB
	name, key string
}

// admitted is one key's slots: a token in slots per call in flight, users the calls in flight or
// waiting (the entry is dropped when it comes back to zero), and until when a refusal opened it.
// The opening lets through the calls of openCount tokens or more, reservations only when
// openReserve.
type admitted struct {
	slots       chan struct{}
	users       int
	open        time.Time
	openCount   float64
	openReserve bool
}

// ticket is a call's admission: leave gives back its slot, if it took one.
type ticket struct {
	a       *admission
	k       admissionKey
	e       *admitted
	slot    bool
	count   float64 // the call's count and Reserve, which a refusal opens the key for
	reserve bool
}

// leave ends the call's admission, given the call's answer d (the zero answer after an error): a
// refusal opens the key for the calls like it, for its RetryAt less its Time (admitWait at most).
func (t ticket) leave(d answer) {
	if t.slot {
		<-t.e.slots
	}
	t.a.mu.Lock()
	t.opens(d)
	// The key's entry may have been replaced by one of another number of slots (enter).
	if t.e.users--; t.e.users == 0 && t.a.keys[t.k] == t.e {
		delete(t.a.keys, t.k)
	}
	t.a.mu.Unlock()
}

// opens opens the key for the calls like t's when d, its call's answer, is a refusal, from now; the
// caller holds t.a.mu.
func (t ticket) opens(d answer) {
	if refusedFor := d.refusedFor(); refusedFor > 0 {
		t.e.open = time.Now().Add(min(refusedFor, t.a.bound()))
		t.e.openCount, t.e.openReserve = t.count, t.reserve
	}
}

func (a *admission) bound() time.Duration {
	if a.wait == 0 {
		return admitWait
	}
	return a.wait
}

// admitWait bounds a wait for a slot: that of a wait for a steering lock (txlimit_await_shard).
const admitWait = 100 * time.Millisecond

// enter takes one of the n slots of (name, key) on db for a call of count tokens (with Reserve when
// reserve), waiting for one at most admitWait, and returns the call's ticket, to leave once the
// call has returned. When the wait times out, or a refusal opened the key for calls like this one,
// it goes on without a slot; when ctx ends first it returns ctx's error. A call whose n differs
// from the key's number of slots (an inline Config that changes Shards) starts the key afresh with
// n slots: the calls in flight keep theirs and give them back to the old entry.
func (a *admission) enter(ctx context.Context, db any, name, key string, n int, count float64, reserve bool) (ticket, error) {
	t := ticket{a: a, k: admissionKey{db, name, key}, count: count, reserve: reserve}
	a.mu.Lock()
	if a.keys == nil {
		a.keys = map[admissionKey]*admitted{}
	}
	t.e = a.keys[t.k]
	if t.e == nil || cap(t.e.slots) != n {
		t.e = &admitted{slots: make(chan struct{}, n)}
		a.keys[t.k] = t.e
	}
	t.e.users++
	open := time.Now().Before(t.e.open) && count >= t.e.openCount && (!reserve || t.e.openReserve)
	a.mu.Unlock()
	if open {
		return t, nil
	}
	select {
	case t.e.slots <- struct{}{}:
		t.slot = true
		return t, nil
	default:
	}
	timer := time.NewTimer(a.bound())
	defer timer.Stop()
	select {
	case t.e.slots <- struct{}{}:
		t.slot = true
		return t, nil
	case <-timer.C:
		return t, nil
	case <-ctx.Done():
		t.leave(answer{})
		return ticket{}, ctx.Err()
	}
}

// txAdmission is the admission of the lone calls of one InSerializableTx attempt on a pool: each is
// a call in the attempt's transaction, which keeps the shard it decided on (its steering lock) until
// it ends, so a call's slot is given back when the transaction ends, not when the call returns; a
// refusal opens its key when it returns, as on the pool, for the calls after it that it speaks for.
// A call on a key the transaction already holds a slot of takes none: the transaction has its
// shard. As everywhere, a wait for a slot lasts admitWait at the most, so a transaction that holds
// slots and waits for another key's never deadlocks another one that does the same.
type txAdmission struct {
	pool any    // the pool InSerializableTx runs on
	tx   pgx.Tx // the attempt's transaction: only calls on it are admitted here

	mu    sync.Mutex
	held  []ticket // the tickets taken, given back by leave
	ended bool     // leave has run: a call still on tx (it fails) keeps no ticket
}

type txAdmissionKey struct{}

// withTxAdmission returns ctx carrying the admission of tx, a transaction of InSerializableTx begun
// on db, when db is a pool; else ctx and nil.
func withTxAdmission(ctx context.Context, db TxBeginner, tx pgx.Tx) (context.Context, *txAdmission) {
	pool, ok := db.(*pgxpool.Pool)
	if !ok {
		return ctx, nil
	}
	ta := &txAdmission{pool: pool, tx: tx}
	return context.WithValue(ctx, txAdmissionKey{}, ta), ta
}

// txAdmissionOf returns the admission of the InSerializableTx transaction that db is, as ctx
// carries it; nil when db is another handle.
func txAdmissionOf(ctx context.Context, db Executor) *txAdmission {
	ta, _ := ctx.Value(txAdmissionKey{}).(*txAdmission)
	if ta == nil || any(ta.tx) != any(db) {
		return nil
	}
	return ta
}

// admit admits c, a lone call on the sharded key of s on db (admission.go): on a pool through the
// Limiter's slots, given back when the call returns; on a transaction of InSerializableTx through
// its admission, which keeps the slot until the transaction ends. done takes the call's answer
// (the zero answer after an error); a call on any other handle is not admitted.
func (l *Limiter) admit(ctx context.Context, db Executor, s *spec, c *call) (done func(answer), err error) {
	if pool := poolOf(db); pool != nil {
		t, err := l.admission.enter(ctx, pool, s.name, s.key, s.shards, c.asks[0].count, c.asks[0].reserve)
		return t.leave, err
	}
	if ta := txAdmissionOf(ctx, db); ta != nil {
		t, err := ta.enter(ctx, &l.admission, s.name, s.key, s.shards, c.asks[0].count, c.asks[0].reserve)
		return func(d answer) { ta.keep(t, d) }, err
	}
	return func(answer) {}, nil
}

// enter admits a call of the transaction on (name, key) through a, as admission.enter does, unless
// the transaction already holds a slot of that key of a, or has ended (the call fails on tx).
func (ta *txAdmission) enter(ctx context.Context, a *admission, name, key string, n int, count float64, reserve bool) (ticket, error) {
	k := admissionKey{ta.pool, name, key}
	ta.mu.Lock()
	skip := ta.ended || slices.ContainsFunc(ta.held, func(t ticket) bool { return t.a == a && t.k == k && t.slot })
	ta.mu.Unlock()
	if skip {
		return ticket{}, nil
	}
	return a.enter(ctx, ta.pool, name, key, n, count, reserve)
}

// keep holds t until the transaction ends, d being its call's answer: a refusal opens the key at
// once. When the transaction has already ended (a call that outlived it), t is given back at once.
func (ta *txAdmission) keep(t ticket, d answer) {
	if t.a == nil {
		return
	}
	t.a.mu.Lock()
	t.opens(d)
	t.a.mu.Unlock()
	ta.mu.Lock()
	ended := ta.ended
	if !ended {
		ta.held = append(ta.held, t)
	}
	ta.mu.Unlock()
	if ended {
		t.leave(answer{})
	}
}

// leave gives back every ticket the transaction held; it runs once the transaction has ended.
func (ta *txAdmission) leave() {
	ta.mu.Lock()
	held := ta.held
	ta.held, ta.ended = nil, true
	ta.mu.Unlock()
	for _, t := range held {
		t.leave(answer{}) // the refusals among their calls opened the key when they returned
	}
}
