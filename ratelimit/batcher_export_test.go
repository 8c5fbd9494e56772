package ratelimit

import "context"

// SetBatchObserver makes b call f with the contexts of each batch, in arrival order, just before
// the batch is decided (on the lane's goroutine). Set it before the first call.
func SetBatchObserver(b *Batcher, f func(ctxs []context.Context)) { b.observe = f }

// QueuedCalls returns how many calls wait in b's queues (not those being decided).
func QueuedCalls(b *Batcher) int {
	n := 0
	for _, ln := range b.lanes {
		ln.mu.Lock()
		n += len(ln.queue)
		ln.mu.Unlock()
	}
	return n
}

// LaneOf returns the index of the lane that decides (name, key).
func LaneOf(b *Batcher, name, key string) int {
	ln := b.laneOf(name, key)
	for i, l := range b.lanes {
		if l == ln {
			return i
		}
	}
	return -1
}

// HoldLane locks lane i's mutex until release is called: a Close marking the lanes stops there.
func HoldLane(b *Batcher, i int) (release func()) {
	b.lanes[i].mu.Lock()
	return b.lanes[i].mu.Unlock
}

// LaneClosed reports whether Close has marked lane i closed.
func LaneClosed(b *Batcher, i int) bool {
	b.lanes[i].mu.Lock()
	defer b.lanes[i].mu.Unlock()
	return b.lanes[i].closed
}
