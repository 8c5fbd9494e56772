// Package httplimit is net/http middleware that rate-limits requests with txlimit and tells
// clients about it with the RateLimit-Policy and RateLimit fields of the IETF draft
// draft-ietf-httpapi-ratelimit-headers (https://datatracker.ietf.org/doc/draft-ietf-httpapi-ratelimit-headers/),
// as its revision -10 defines them (parameters q, qu, w and pk of a policy; r, t and pk of a service
// limit; the quota-exceeded problem type).
//
// A Middleware has one or more policies, each a named limit (a ratelimit.Config) and a KeyFunc
// that names the client: its IP address (ClientIP), a header (Header), or anything a
// func(*http.Request) (string, error) can find, such as the authenticated user. Every request
// takes Cost tokens (default 1) of every policy at once, all or nothing, in one round trip
// (ratelimit.Limiter.LimitMany): per IP AND per user, and a request denied by one consumes
// nothing of the other.
//
// # Responses
//
// A granted request goes on to the next handler with the RateLimit-Policy and RateLimit fields
// set (unless Config.OmitSuccessHeaders). A denied one gets 429 Too Many Requests with those
// fields, Retry-After and an application/problem+json body (RFC 9457) of the draft's
// quota-exceeded problem type, listing the violated policies in "violated-policies".
//
// Both fields are Structured Field Lists (RFC 9651), one Item per policy, named by the policy:
//
//	RateLimit-Policy: "perIP";q=10;w=60;pk=:...:, "perUser";q=100;w=3600;pk=:...:
//	RateLimit: "perIP";r=2;t=6;pk=:...:, "perUser";r=97;t=36;pk=:...:
//
// The parameters:
//   - q, the quota: Rate rounded down, and w, the window: Period in seconds rounded up. For a
//     fixed window the quota is the lesser of Rate and Capacity, since a window grants at most
//     Capacity. A quota below 1 is given as q=1 over w = Period/quota seconds, rounded up (a
//     policy that the middleware decides at a cost of 1 needs a Capacity of at least 1: see
//     New). When Capacity (the burst) differs from Rate it is given as txlimit-burst, rounded
//     down.
//   - qu, the quota unit: Policy.QuotaUnit, left out when empty (the draft then reads q and r
//     as requests). With Config.Cost, q and r count tokens: set it to say what a token is
//     ("content-bytes" for a cost from the request's size).
//   - r, the remaining quota units: the tokens left after the request (ratelimit.Result.Value),
//     rounded down, and 0 when negative (reservations). In a denied request, a policy that alone
//     would have been granted shows what it would have left: nothing was consumed, so the true
//     figure is higher by the cost, and r errs on the safe side.
//   - t, the seconds until more quota is available, rounded up: for a denied policy, until the
//     request would be granted (ratelimit.Result.RetryAt − Time); for a granted token bucket, until
//     r grows by one; left out when r cannot grow by one (the limit is full, or full holds less
//     than r + 1: a Capacity that is not whole, less a cost below 1) and, for a granted fixed
//     window, always.
//     With Shards N >= 2, r covers only the shards the call looked at: two, full at 2·Capacity/N,
//     each refilling at Rate/N while below its capacity. The Result does not say which is full,
//     so t counts one of them refilling: never too soon, at most twice the wait when both refill.
//   - pk, the partition key: the first 12 bytes of HMAC-SHA256(Secret, name + 0x00 + key), so
//     clients can tell partitions apart but never learn the key (an IP address or user id), and
//     keys cannot be guessed from it without Config.Secret.
//
// Retry-After is the longest wait of the denied policies in whole seconds, rounded up, plus a
// jitter of 0 to Config.RetryJitter whole seconds. The jitter is deterministic per identity: the
// first 8 bytes of HMAC-SHA256(Secret, "retry-after" + for each policy 0x00 + key), as a big-endian
// unsigned integer, modulo (RetryJitter in whole seconds + 1). A client gets the same jitter each
// time, and clients limited together spread out instead of coming back together. Retry-After is
// never earlier than the t of a denied policy, as the draft asks.
//
// # Errors
//
// A database error fails closed: 503 Service Unavailable with Retry-After
// (Config.FailClosedRetryAfter, DefaultFailClosedRetryAfter = 5 s unless set, plus the jitter
// above), counted (outcome "error") and logged at error level. Config.FailOpen lets the request
// through instead, counted (outcome "fail_open") and logged at warn level. Neither is silent by
// default: with Config.Logger nil the record goes to slog.Default(), with Config.MeterProvider
// nil the count to the global provider. A database that hangs fails no call: Config.DecisionTimeout
// bounds the wait, and a decision not made within it failed as above (without it, a request waits
// until its own context ends, which is no failure: see below).
// A request whose own context ends before its decision (the client went away, or the request's
// deadline passed, and the Decider returns context.Canceled or context.DeadlineExceeded) is no
// failed decision: it is not let through, not even with Config.FailOpen (nobody waits for its
// answer, or the time it had is up; through a Batcher it may have been charged when its batch was
// already deciding), nor logged; it is answered without a body, 499 (nginx's "client closed
// request") when it was cancelled without a cause, as net/http cancels a request whose client went
// away, and 503 otherwise (its deadline passed, or the server cancelled it with a cause, shutting
// down, say: the client may still be waiting), and counted (outcome "canceled"). Under
// Config.Shadow it goes on to the next handler, as every request does.
// Invalid input, such as a key longer than ratelimit.MaxKeyLen taken from a header or a negative
// cost, is 400 Bad Request (ratelimit.ErrInvalid). A request for which a KeyFunc finds no key gets
// the policy's MissingKey outcome: 400 by default, or the policy is skipped, or shared by every
// keyless request. Config.Shadow decides and counts but never refuses a request (not even on a
// database error), to watch a new limit before enforcing it.
//
// # Client addresses behind proxies
//
// ClientIP keys a request by the address it came from (Request.RemoteAddr). Behind reverse
// proxies that address is the proxy's, and the client's is in a header the proxies write. Anyone
// can send such a header, and proxies pass on what the client sent (Go's httputil.ReverseProxy
// appends to a client's X-Forwarded-For and passes its Forwarded on unchanged), so ClientIP
// believes a header only as IPOpts says: only the one header the proxies write (IPOpts.Header,
// X-Forwarded-For by default), only from a trusted peer, and only the part the trusted proxies
// wrote, read from the right. Other forwarding headers are ignored. The usual set-ups:
//
//	// No proxy: the peer is the client. Forwarding headers are ignored.
//	httplimit.ClientIP(nil)
//
//	// One proxy (nginx, a load balancer, httputil.ReverseProxy) on 10.0.0.0/8, appending to
//	// X-Forwarded-For: the right-most address not in 10.0.0.0/8.
//	proxies := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
//	httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: proxies})
//
//	// A CDN in front of that proxy: trust the CDN's published ranges too...
//	httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: append(cdnRanges, proxies...)})
//	// ...or count the hops: the proxy appended the CDN's address, the CDN the client's, which
//	// is then the second from the right.
//	httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: proxies, TrustedProxyCount: 2})
//
//	// A proxy that sets X-Real-IP (nginx: proxy_set_header X-Real-IP $remote_addr).
//	httplimit.ClientIP(&httplimit.IPOpts{Header: "X-Real-IP", TrustedProxies: proxies})
//
// Set Header to the one your proxies write and make sure the one facing the clients overwrites or
// appends to it: a header the proxies only pass on is the client's to choose. Trusting a network
// means that every host in it is a proxy that writes the header: a client that can reach the
// server from inside it can choose its key. TrustedProxyCount without TrustedProxies believes any
// peer, so the server must be reachable only through the proxies.
//
// # Deciding in the handler
//
// A middleware decides before the handler runs, so it cannot decide inside the handler's
// transaction. A handler that limits and writes in its own transaction calls
// Middleware.WriteHeaders (or WriteDenied) with its results to send the same fields; describe its
// limit with a Policy whose Key is nil, which the middleware itself does not decide.
//
// # Metrics
//
// Config.MeterProvider (the global provider by default) counts requests by policy and outcome
// (txlimit.http.requests); the Limiter's own metrics (ratelimit.LimiterConfig.MeterProvider)
// count the decisions.
package httplimit
