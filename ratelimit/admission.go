package ratelimit

import (
	"context"
	"sync"
	"time"
)

// admission keeps the lone calls that one Limiter runs on a *pgxpool.Pool for one key of a sharded
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
type admission struct {
	mu   sync.Mutex
	keys map[admissionKey]*admitted // the keys with a call in flight or waiting
	wait time.Duration              // the bound of a wait; 0: admitWait (tests change it)
}

type admissionKey struct{ name, key string }

// admitted is one key's slots: a token in slots per call in flight, users the calls in flight or
// waiting (the entry is dropped when it comes back to zero).
type admitted struct {
	slots chan struct{}
	users int
}

// admitWait bounds a wait for a slot: that of a wait for a steering lock (txlimit_await_shard).
const admitWait = 100 * time.Millisecond

// enter takes one of the n slots of (name, key), waiting for one at most admitWait, and returns
// the function that gives it back (to be called once the call has returned). When the wait times
// out it goes on without a slot; when ctx ends first it returns ctx's error. The first call of a
// key sets its number of slots; an inline Config that changes Shards takes effect once the key's
// calls in flight have drained.
func (a *admission) enter(ctx context.Context, name, key string, n int) (leave func(), err error) {
	k := admissionKey{name, key}
	a.mu.Lock()
	if a.keys == nil {
		a.keys = map[admissionKey]*admitted{}
	}
	e := a.keys[k]
	if e == nil {
		e = &admitted{slots: make(chan struct{}, n)}
		a.keys[k] = e
	}
	e.users++
	a.mu.Unlock()
	out := func() {
		a.mu.Lock()
		if e.users--; e.users == 0 {
			delete(a.keys, k)
		}
		a.mu.Unlock()
	}
	select {
	case e.slots <- struct{}{}:
		return func() { <-e.slots; out() }, nil
	default:
	}
	wait := a.wait
	if wait == 0 {
		wait = admitWait
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case e.slots <- struct{}{}:
		return func() { <-e.slots; out() }, nil
	case <-t.C:
		return out, nil
	case <-ctx.Done():
		out()
		return nil, ctx.Err()
	}
}
