package httplimit

import (
	"errors"
	"fmt"
	"iter"
	"net"
	"net/http"
	"net/netip"
	"strings"

	"github.com/realclientip/realclientip-go"
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

// IPOpts are the options of ClientIP. A nil *IPOpts is the zero value: no trusted proxies, so
// the key is the immediate peer (Request.RemoteAddr). The package doc ("Client addresses behind
// proxies") shows the common set-ups.
type IPOpts struct {
	// Header is the one header the trusted proxies write the client's address into, and the only
	// one ClientIP reads; any other forwarding header is ignored, whatever it says:
	//   - "X-Forwarded-For": each proxy appends the address it received the request from (Go's
	//     httputil.ReverseProxy with a Director, or with a Rewrite that calls SetXForwarded;
	//     nginx's $proxy_add_x_forwarded_for). The client is the right-most address not in
	//     TrustedProxies, or the TrustedProxyCount-th from the right.
	//   - "Forwarded" (RFC 7239): each proxy appends an element with a for= parameter; read as
	//     X-Forwarded-For. httputil.ReverseProxy does not write it: its Director passes a client's
	//     own Forwarded on unchanged, and a Rewrite removes it.
	//   - "X-Real-IP": one address, set (not appended) by the proxy that faces the clients and
	//     passed on unchanged by any behind it. Only TrustedProxies applies.
	// It is read only when a proxy is trusted (TrustedProxies or TrustedProxyCount). Names are
	// case-insensitive. Defaults to "X-Forwarded-For".
	Header string

	// IPv4Prefix groups IPv4 clients by this many leading bits (1 to 32). Defaults to 32: one
	// key per address.
	IPv4Prefix int

	// IPv6Prefix groups IPv6 clients by this many leading bits (1 to 128): one host usually holds
	// a whole /64, so a key per address would let it take as many quotas as it likes. Defaults
	// to 64.
	IPv6Prefix int

	// TrustedProxies are the networks of the reverse proxies in front of the server. Header is
	// read only when the immediate peer (Request.RemoteAddr) is in one of them; otherwise the
	// peer is the client. Unless TrustedProxyCount is set, the client is then the right-most
	// address in Header that is not in one of them. Anyone can send the header, so trusting a
	// network that clients can reach the server from lets them choose their key. An IPv4-mapped
	// IPv6 network (::ffff:10.0.0.0/104) stands for the IPv4 network it maps. Defaults to none.
	TrustedProxies []netip.Prefix

	// TrustedProxyCount is the number of proxies that each append one address to Header
	// ("X-Forwarded-For" or "Forwarded"): the client is the TrustedProxyCount-th address from the
	// right (1: the right-most, which the proxy facing the server wrote). Use it when the proxies'
	// addresses are not known in advance. Without TrustedProxies the header is believed whoever
	// sends it, so the server must be reachable only through the proxies; with TrustedProxies,
	// only from a peer in them. Defaults to 0: the client is found by TrustedProxies alone.
	TrustedProxyCount int
}

// ClientIP returns a KeyFunc naming the client by its IP address (see IPOpts): an IPv4 address
// ("192.0.2.7", or a prefix such as "192.0.2.0/24" when IPv4Prefix < 32) or an IPv6 prefix
// ("2001:db8:1:2::/64"). IPv4-mapped IPv6 addresses count as IPv4.
//
// The client is the immediate peer (Request.RemoteAddr) unless a proxy is trusted and the request
// came through it; then it is read from IPOpts.Header alone, from the right. A request from a
// trusted peer without that header is the peer's own (a health check, say). One with the header
// that names no client (every address in it trusted, fewer addresses than TrustedProxyCount, or
// the client's entry not an IP address, such as Forwarded's for=unknown) has no key: ErrNoKey, and
// the policy's MissingKey decides. The header is read from the right one entry at a time, up to the
// client's: the entries left of it, which the client may have filled at will, are not parsed.
//
// RemoteAddr is taken as the peer's address: a middleware in front of this one that rewrites it
// from a header (chi's middleware.RealIP, gorilla's handlers.ProxyHeaders) lets any client choose
// its key. Leave RemoteAddr as the connection set it, and name the proxies in IPOpts instead.
//
// It panics on invalid options, as regexp.MustCompile does on a bad pattern: the message says
// what to set.
func ClientIP(opts *IPOpts) KeyFunc {
	o := IPOpts{Header: headerXFF, IPv4Prefix: 32, IPv6Prefix: 64}
	headerSet := false
	if opts != nil {
		if opts.Header != "" {
			o.Header, headerSet = http.CanonicalHeaderKey(opts.Header), true
		}
		if opts.IPv4Prefix != 0 {
			o.IPv4Prefix = opts.IPv4Prefix
		}
		if opts.IPv6Prefix != 0 {
			o.IPv6Prefix = opts.IPv6Prefix
		}
		o.TrustedProxies = append(o.TrustedProxies, opts.TrustedProxies...)
		o.TrustedProxyCount = opts.TrustedProxyCount
	}
	if o.IPv4Prefix < 1 || o.IPv4Prefix > 32 {
		panic(fmt.Sprintf("httplimit: ClientIP: set IPOpts.IPv4Prefix to 1..32, or 0 for the default 32 (got %d)", o.IPv4Prefix))
	}
	if o.IPv6Prefix < 1 || o.IPv6Prefix > 128 {
		panic(fmt.Sprintf("httplimit: ClientIP: set IPOpts.IPv6Prefix to 1..128, or 0 for the default 64 (got %d)", o.IPv6Prefix))
	}
	if o.Header != headerXFF && o.Header != headerForwarded && o.Header != headerRealIP {
		panic(fmt.Sprintf(`httplimit: ClientIP: set IPOpts.Header to the one header your proxies write: "X-Forwarded-For" (the default), "Forwarded" or "X-Real-IP" (got %q)`, opts.Header))
	}
	// The trusted networks, an IPv4-mapped IPv6 one (::ffff:10.0.0.0/104) as the IPv4 network it
	// maps (10.0.0.0/8): peers and header entries are compared as IPv4 (parseAddr unmaps them).
	proxies := make([]netip.Prefix, len(o.TrustedProxies))
	for i, p := range o.TrustedProxies {
		if !p.IsValid() {
			panic(fmt.Sprintf(`httplimit: ClientIP: set IPOpts.TrustedProxies[%d] to a valid network, e.g. netip.MustParsePrefix("10.0.0.0/8") (got %s)`, i, p))
		}
		if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
		}
		proxies[i] = p
	}
	name := o.Header // as the documentation spells it
	if name == headerRealIP {
		name = "X-Real-IP"
	}
	if o.TrustedProxyCount < 0 {
		panic(fmt.Sprintf("httplimit: ClientIP: set IPOpts.TrustedProxyCount to the number of proxies that append to %s, or 0 to find the client by TrustedProxies (got %d)", name, o.TrustedProxyCount))
	}
	if o.TrustedProxyCount > 0 && o.Header == headerRealIP {
		panic(fmt.Sprintf("httplimit: ClientIP: set IPOpts.TrustedProxies to the networks of your proxies instead of TrustedProxyCount (%d): X-Real-IP holds one address, not one per proxy", o.TrustedProxyCount))
	}
	if headerSet && len(o.TrustedProxies) == 0 && o.TrustedProxyCount == 0 {
		panic(fmt.Sprintf("httplimit: ClientIP: set IPOpts.TrustedProxies (or TrustedProxyCount) too: without a trusted proxy IPOpts.Header %q is never read and the key is RemoteAddr", opts.Header))
	}

	// strategy reads the client from the header; noClient says why it found none.
	var strategy realclientip.Strategy
	var noClient string
	var err error
	switch {
	case o.Header == headerRealIP:
		strategy, err = realclientip.NewSingleIPHeaderStrategy(o.Header)
		noClient = "is not an IP address"
	case o.TrustedProxyCount > 0:
		rm := rightmost{header: o.Header, count: o.TrustedProxyCount}
		rm.entry, err = realclientip.NewRightmostTrustedCountStrategy(o.Header, 1)
		strategy = rm
		noClient = fmt.Sprintf("has fewer than IPOpts.TrustedProxyCount (%d) addresses, or the one at that place from the right is not an IP address", o.TrustedProxyCount)
	case len(o.TrustedProxies) > 0:
		noClient = "names no address outside IPOpts.TrustedProxies, or the right-most such entry is not an IP address"
		nets := make([]net.IPNet, len(proxies))
		for i, p := range proxies {
			p = p.Masked()
			nets[i] = net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
		}
		rm := rightmost{header: o.Header}
		rm.entry, err = realclientip.NewRightmostTrustedCountStrategy(o.Header, 1)
		if err == nil {
			rm.untrusted, err = realclientip.NewRightmostTrustedRangeStrategy(o.Header, nets)
		}
		strategy = rm
	}
	if err != nil { // the options were checked above
		panic(fmt.Sprintf("httplimit: ClientIP: %v", err))
	}
	trusted := func(a netip.Addr) bool {
		for _, p := range proxies {
			if p.Contains(a) {
				return true
			}
		}
		return false
	}
	return func(r *http.Request) (string, error) {
		// The peer is needed only where the key is the peer or it must be a trusted proxy: behind
		// TrustedProxyCount alone any peer is trusted, a proxy on a Unix socket (RemoteAddr "@")
		// too. Elsewhere a RemoteAddr that is not an IP (a Unix socket) gives no key, and the
		// policy's MissingKey decides.
		peer, peerOK := parseAddr(r.RemoteAddr)
		client := peer
		switch {
		case strategy == nil, // no trusted proxy
			len(proxies) > 0 && (!peerOK || !trusted(peer)), // not through a trusted proxy
			len(r.Header.Values(o.Header)) == 0:             // the trusted peer's own request
			if !peerOK {
				return "", fmt.Errorf("%w: ClientIP: RemoteAddr %q is not an IP address", ErrNoKey, r.RemoteAddr)
			}
		default:
			s := strategy.ClientIP(r.Header, r.RemoteAddr)
			var ok bool
			if client, ok = parseAddr(s); !ok {
				from := r.RemoteAddr
				if peerOK {
					from = peer.String()
				}
				return "", fmt.Errorf("%w: ClientIP: the %s header from %s %s", ErrNoKey, name, from, noClient)
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

// rightmost is a realclientip.Strategy that reads an X-Forwarded-For or Forwarded header from the
// right, one entry at a time, and stops at the client: realclientip's own strategies parse every
// entry of the header first, and a client can send a megabyte of them. Each entry is parsed by
// realclientip as a header of that entry alone (entries hold no comma), so the answer is the one
// its RightmostTrustedCountStrategy (count) or RightmostTrustedRangeStrategy (untrusted) gives
// on the whole header.
type rightmost struct {
	header string
	// count is the place of the client from the right; 0: the right-most entry untrusted reads.
	count int
	// entry reads a header of one entry: its address, or "" when it is none.
	entry realclientip.Strategy
	// untrusted reads a header of one entry: its address when it is not in a trusted network,
	// else "" (trusted, or not an address).
	untrusted realclientip.Strategy
}

// ClientIP returns the client's address in headers, or "" when it names none.
func (s rightmost) ClientIP(headers http.Header, _ string) string {
	one := http.Header{s.header: {""}}
	n := 0
	for entry := range entriesFromRight(headers[s.header]) {
		one[s.header][0] = entry
		if n++; s.count > 0 {
			if n == s.count {
				return s.entry.ClientIP(one, "")
			}
			continue
		}
		if a := s.untrusted.ClientIP(one, ""); a != "" {
			return a
		}
		if s.entry.ClientIP(one, "") == "" { // not an address; else a trusted one
			return ""
		}
	}
	return "" // fewer than count entries, or every one trusted
}

// entriesFromRight yields the entries of the lines of a list header as realclientip splits them
// (each line at every comma, the lines in order), from the right-most on: finding one costs the
// scan of the bytes right of it, not of the whole header.
func entriesFromRight(lines []string) iter.Seq[string] {
	return func(yield func(string) bool) {
		for i := len(lines) - 1; i >= 0; i-- {
			line := lines[i]
			for {
				j := strings.LastIndexByte(line, ',')
				if !yield(line[j+1:]) {
					return
				}
				if j < 0 {
					break
				}
				line = line[:j]
			}
		}
	}
}

// The headers ClientIP can read, canonical (http.CanonicalHeaderKey).
const (
	headerXFF       = "X-Forwarded-For"
	headerForwarded = "Forwarded"
	headerRealIP    = "X-Real-Ip"
)

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
