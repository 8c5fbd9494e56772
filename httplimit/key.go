package httplimit

import (
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
)

// KeyFunc names the client a request is counted against, e.g. its IP address or user id. It
// returns "" or ErrNoKey when the request has none (the policy's MissingKey decides), and any
// other error for a request it cannot make sense of (400 Bad Request).
type KeyFunc func(r *http.Request) (string, error)

// ErrNoKey is returned (or wrapped) by a KeyFunc for a request that carries no key.
var ErrNoKey = errors.New("httplimit: the request has no key")

// Header returns a KeyFunc that takes the key from the request header name, trimmed of spaces; a
// missing or empty header is ErrNoKey. A value longer than ratelimit.MaxKeyLen is a 400.
func Header(name string) KeyFunc {
	return func(r *http.Request) (string, error) {
		v := strings.TrimSpace(r.Header.Get(name))
		if v == "" {
			return "", ErrNoKey
		}
		return v, nil
	}
}

// IPOpts are the options of ClientIP. A nil *IPOpts is the zero value.
type IPOpts struct {
	// IPv4Prefix groups IPv4 clients by this many leading bits (1 to 32). Defaults to 32: one
	// key per address.
	IPv4Prefix int

	// IPv6Prefix groups IPv6 clients by this many leading bits (1 to 128): one host usually holds
	// a whole /64, so a key per address would let it take as many quotas as it likes. Defaults
	// to 64.
	IPv6Prefix int

	// TrustedProxies are the networks of the reverse proxies in front of the server. Only when
	// the immediate peer (Request.RemoteAddr) is in one of them are the Forwarded,
	// X-Forwarded-For and X-Real-IP headers believed (the first of them present, in that order),
	// and then the client is the right-most address in them that is not itself a trusted proxy.
	// Anyone can send these headers, so trusting a network that clients can reach directly lets
	// them choose their key. Defaults to none: the key is always the immediate peer.
	TrustedProxies []netip.Prefix
}

// ClientIP returns a KeyFunc naming the client by its IP address (see IPOpts): an IPv4 address
// ("192.0.2.7", or a prefix such as "192.0.2.0/24" when IPv4Prefix < 32) or an IPv6 prefix
// ("2001:db8:1:2::/64"). IPv4-mapped IPv6 addresses count as IPv4. It panics when a prefix length
// is out of range, as regexp.MustCompile does on a bad pattern.
func ClientIP(opts *IPOpts) KeyFunc {
	o := IPOpts{IPv4Prefix: 32, IPv6Prefix: 64}
	if opts != nil {
		if opts.IPv4Prefix != 0 {
			o.IPv4Prefix = opts.IPv4Prefix
		}
		if opts.IPv6Prefix != 0 {
			o.IPv6Prefix = opts.IPv6Prefix
		}
		o.TrustedProxies = append(o.TrustedProxies, opts.TrustedProxies...)
	}
	if o.IPv4Prefix < 1 || o.IPv4Prefix > 32 {
		panic(fmt.Sprintf("httplimit: IPOpts.IPv4Prefix must be 1 to 32 (got %d)", o.IPv4Prefix))
	}
	if o.IPv6Prefix < 1 || o.IPv6Prefix > 128 {
		panic(fmt.Sprintf("httplimit: IPOpts.IPv6Prefix must be 1 to 128 (got %d)", o.IPv6Prefix))
	}
	trusted := func(a netip.Addr) bool {
		for _, p := range o.TrustedProxies {
			if p.Contains(a) {
				return true
			}
		}
		return false
	}
	return func(r *http.Request) (string, error) {
		peer, ok := parseAddr(r.RemoteAddr)
		if !ok {
			// A Unix socket, say: no IP to key on; the policy's MissingKey decides.
			return "", fmt.Errorf("%w: ClientIP: RemoteAddr %q is not an IP address", ErrNoKey, r.RemoteAddr)
		}
		client := peer
		if trusted(peer) {
			// Walk from the right (the hop nearest to us) to the first address that is not a
			// trusted proxy. An unparsable entry ends the walk at the last address believed.
			chain := forwardedFor(r.Header)
			for i := len(chain) - 1; i >= 0; i-- {
				a, ok := parseAddr(chain[i])
				if !ok {
					break
				}
				client = a
				if !trusted(a) {
					break
				}
			}
		}
		bits := o.IPv6Prefix
		if client.Is4() {
			bits = o.IPv4Prefix
			if bits == 32 {
				return client.String(), nil
			}
		}
		p, err := client.Prefix(bits)
		if err != nil {
			return "", fmt.Errorf("httplimit: ClientIP: %w", err)
		}
		return p.String(), nil
	}
}

// forwardedFor returns the client addresses the proxies reported, left (origin) to right (nearest
// proxy), from the first of Forwarded, X-Forwarded-For and X-Real-IP that is present. Several
// fields of one name are one list, in order.
func forwardedFor(h http.Header) []string {
	var out []string
	if fs := h.Values("Forwarded"); len(fs) > 0 {
		for _, f := range fs {
			for elem := range strings.SplitSeq(f, ",") {
				for pair := range strings.SplitSeq(elem, ";") {
					k, v, ok := strings.Cut(strings.TrimSpace(pair), "=")
					if ok && strings.EqualFold(k, "for") {
						out = append(out, strings.Trim(v, `"`))
					}
				}
			}
		}
		return out
	}
	if fs := h.Values("X-Forwarded-For"); len(fs) > 0 {
		for _, f := range fs {
			for a := range strings.SplitSeq(f, ",") {
				out = append(out, strings.TrimSpace(a))
			}
		}
		return out
	}
	if v := strings.TrimSpace(h.Get("X-Real-IP")); v != "" {
		return []string{v}
	}
	return nil
}

// parseAddr parses "addr", "addr:port", "[v6]" or "[v6]:port", dropping any zone and unmapping
// IPv4-mapped IPv6 addresses.
func parseAddr(s string) (netip.Addr, bool) {
	s = strings.TrimSpace(s)
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap().WithZone(""), true
	}
	a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(s, "["), "]"))
	if err != nil {
		return netip.Addr{}, false
	}
	return a.Unmap().WithZone(""), true
}
