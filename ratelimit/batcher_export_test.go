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
