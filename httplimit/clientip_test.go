package httplimit_test

import (
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/realclientip/realclientip-go"
	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/httplimit"
)

func prefixes(s ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(s))
	for i, p := range s {
		out[i] = netip.MustParsePrefix(p)
	}
	return out
}

// Issue 31, item 1: with the proxy trusted, a client's own Forwarded header chose its key
// (203.0.113.99). Only the header the proxies write is read: X-Forwarded-For by default.
func TestClientIPIssue31(t *testing.T) {
	t.Parallel()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "10.0.0.1:4000"
	r.Header.Set("X-Forwarded-For", "198.51.100.7")
	r.Header.Set("Forwarded", "for=203.0.113.99")
	key, err := httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: prefixes("10.0.0.1/32")})(r)
	require.NoError(t, err)
	require.Equal(t, "198.51.100.7", key)
}

func TestClientIP(t *testing.T) {
	t.Parallel()
	trust10 := prefixes("10.0.0.0/8")
	for i, c := range []struct {
		name   string
		opts   *httplimit.IPOpts
		remote string
		header []string // name, value, name, value...
		want   string   // the key; "" when the request has no key (ErrNoKey)
	}{
		{"no options: the peer, headers ignored", nil, "198.51.100.1:1234",
			[]string{"X-Forwarded-For", "203.0.113.1", "Forwarded", "for=203.0.113.2", "X-Real-IP", "203.0.113.3"}, "198.51.100.1"},
		{"untrusted peer: the peer", &httplimit.IPOpts{TrustedProxies: trust10}, "198.51.100.1:1234",
			[]string{"X-Forwarded-For", "203.0.113.1"}, "198.51.100.1"},
		{"trusted peer: right-most untrusted in X-Forwarded-For", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "203.0.113.9, 198.51.100.7, 10.0.0.2"}, "198.51.100.7"},
		{"several X-Forwarded-For lines are one list", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "203.0.113.9", "X-Forwarded-For", "198.51.100.7, 10.0.0.2"}, "198.51.100.7"},
		{"Forwarded and X-Real-IP ignored by default", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"Forwarded", "for=203.0.113.2", "X-Real-IP", "203.0.113.3", "X-Forwarded-For", "198.51.100.7"}, "198.51.100.7"},
		{"trusted peer without the header: its own request", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"Forwarded", "for=203.0.113.2", "X-Real-IP", "203.0.113.3"}, "10.0.0.1"},
		{"every address trusted: no key", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "10.0.0.7, 10.0.0.2"}, ""},
		{"right-most untrusted entry not an address: no key", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "198.51.100.7, unknown, 10.0.0.2"}, ""},
		{"IPv4-mapped IPv6 is IPv4", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "::ffff:198.51.100.7"}, "198.51.100.7"},
		{"IPv6 grouped by /64", &httplimit.IPOpts{TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "2001:db8:1:2:ffff::9"}, "2001:db8:1:2::/64"},
		{"IPv4 grouped by IPv4Prefix", &httplimit.IPOpts{TrustedProxies: trust10, IPv4Prefix: 24}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "198.51.100.7"}, "198.51.100.0/24"},
		{"IPv6 proxies", &httplimit.IPOpts{TrustedProxies: prefixes("fd00::/8")}, "[fd00::1]:1234",
			[]string{"X-Forwarded-For", "198.51.100.7, fd00::2"}, "198.51.100.7"},

		{"count: the second from the right", &httplimit.IPOpts{TrustedProxyCount: 2}, "192.0.2.50:1234",
			[]string{"X-Forwarded-For", "203.0.113.9, 198.51.100.7, 192.0.2.1"}, "198.51.100.7"},
		{"count: one is the right-most", &httplimit.IPOpts{TrustedProxyCount: 1}, "192.0.2.50:1234",
			[]string{"X-Forwarded-For", "203.0.113.9, 198.51.100.7"}, "198.51.100.7"},
		{"count: fewer addresses than proxies: no key", &httplimit.IPOpts{TrustedProxyCount: 2}, "192.0.2.50:1234",
			[]string{"X-Forwarded-For", "198.51.100.7"}, ""},
		{"count: without the header, the peer", &httplimit.IPOpts{TrustedProxyCount: 2}, "192.0.2.50:1234",
			[]string{"Forwarded", "for=203.0.113.2"}, "192.0.2.50"},
		{"count and networks: untrusted peer", &httplimit.IPOpts{TrustedProxyCount: 2, TrustedProxies: trust10}, "192.0.2.50:1234",
			[]string{"X-Forwarded-For", "203.0.113.9, 198.51.100.7, 192.0.2.1"}, "192.0.2.50"},
		{"count and networks: trusted peer", &httplimit.IPOpts{TrustedProxyCount: 2, TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "203.0.113.9, 198.51.100.7, 192.0.2.1"}, "198.51.100.7"},

		{"Forwarded: the header named", &httplimit.IPOpts{Header: "Forwarded", TrustedProxies: prefixes("10.0.0.1/32")}, "10.0.0.1:4000",
			[]string{"X-Forwarded-For", "198.51.100.7", "Forwarded", "for=203.0.113.99"}, "203.0.113.99"},
		{"Forwarded: right-most untrusted, quoted, with port and parameters", &httplimit.IPOpts{Header: "forwarded", TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"Forwarded", `for=203.0.113.9, for="[2001:db8:1:2::77]:4711";proto=https, For=10.0.0.2;by=10.0.0.1`}, "2001:db8:1:2::/64"},
		{"Forwarded: X-Forwarded-For ignored", &httplimit.IPOpts{Header: "Forwarded", TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "203.0.113.1", "Forwarded", "for=198.51.100.7"}, "198.51.100.7"},
		{"Forwarded: for=unknown is no key", &httplimit.IPOpts{Header: "Forwarded", TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"Forwarded", "for=unknown, for=10.0.0.2"}, ""},
		{"Forwarded: count", &httplimit.IPOpts{Header: "Forwarded", TrustedProxyCount: 2}, "10.0.0.1:1234",
			[]string{"Forwarded", "for=203.0.113.9, for=198.51.100.7, for=192.0.2.1"}, "198.51.100.7"},

		{"X-Real-IP: the header named", &httplimit.IPOpts{Header: "X-Real-IP", TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Forwarded-For", "203.0.113.1", "Forwarded", "for=203.0.113.2", "X-Real-IP", "198.51.100.7"}, "198.51.100.7"},
		{"X-Real-IP: the last line", &httplimit.IPOpts{Header: "x-real-ip", TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Real-IP", "203.0.113.3", "X-Real-IP", "198.51.100.7"}, "198.51.100.7"},
		{"X-Real-IP: untrusted peer", &httplimit.IPOpts{Header: "X-Real-IP", TrustedProxies: trust10}, "198.51.100.1:1234",
			[]string{"X-Real-IP", "203.0.113.3"}, "198.51.100.1"},
		{"X-Real-IP: not an address", &httplimit.IPOpts{Header: "X-Real-IP", TrustedProxies: trust10}, "10.0.0.1:1234",
			[]string{"X-Real-IP", "unknown"}, ""},
	} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = c.remote
		for j := 0; j+1 < len(c.header); j += 2 {
			r.Header.Add(c.header[j], c.header[j+1])
		}
		key, err := httplimit.ClientIP(c.opts)(r)
		if c.want == "" {
			require.ErrorIs(t, err, httplimit.ErrNoKey, "step %d (%s): got key %q", i, c.name, key)
			continue
		}
		require.NoError(t, err, "step %d (%s)", i, c.name)
		require.Equal(t, c.want, key, "step %d (%s)", i, c.name)
	}
}

// A header that names no client says why, under ErrNoKey (the policy's MissingKey decides).
func TestClientIPNoClientErrors(t *testing.T) {
	t.Parallel()
	for i, c := range []struct {
		opts   *httplimit.IPOpts
		header []string
		want   string
	}{
		{&httplimit.IPOpts{TrustedProxies: prefixes("10.0.0.0/8")}, []string{"X-Forwarded-For", "10.0.0.7"},
			"httplimit: the request has no key: ClientIP: the X-Forwarded-For header from 10.0.0.1 names no address outside IPOpts.TrustedProxies, or the right-most such entry is not an IP address"},
		{&httplimit.IPOpts{TrustedProxyCount: 2}, []string{"X-Forwarded-For", "198.51.100.7"},
			"httplimit: the request has no key: ClientIP: the X-Forwarded-For header from 10.0.0.1 has fewer than IPOpts.TrustedProxyCount (2) addresses, or the one at that place from the right is not an IP address"},
		{&httplimit.IPOpts{Header: "x-real-ip", TrustedProxies: prefixes("10.0.0.0/8")}, []string{"X-Real-IP", "unknown"},
			"httplimit: the request has no key: ClientIP: the X-Real-IP header from 10.0.0.1 is not an IP address"},
	} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = "10.0.0.1:1234"
		r.Header.Set(c.header[0], c.header[1])
		_, err := httplimit.ClientIP(c.opts)(r)
		require.ErrorIs(t, err, httplimit.ErrNoKey, "step %d", i)
		require.EqualError(t, err, c.want, "step %d", i)
	}
}

func TestClientIPPanicsOnBadOptions(t *testing.T) {
	t.Parallel()
	trust := prefixes("10.0.0.0/8")
	for i, c := range []struct {
		opts *httplimit.IPOpts
		want string
	}{
		{&httplimit.IPOpts{IPv4Prefix: 33},
			"httplimit: ClientIP: set IPOpts.IPv4Prefix to 1..32, or 0 for the default 32 (got 33)"},
		{&httplimit.IPOpts{IPv6Prefix: -1},
			"httplimit: ClientIP: set IPOpts.IPv6Prefix to 1..128, or 0 for the default 64 (got -1)"},
		{&httplimit.IPOpts{Header: "X-Client-IP", TrustedProxies: trust},
			`httplimit: ClientIP: set IPOpts.Header to the one header your proxies write: "X-Forwarded-For" (the default), "Forwarded" or "X-Real-IP" (got "X-Client-IP")`},
		{&httplimit.IPOpts{TrustedProxies: []netip.Prefix{{}}},
			`httplimit: ClientIP: set IPOpts.TrustedProxies[0] to a valid network, e.g. netip.MustParsePrefix("10.0.0.0/8") (got invalid Prefix)`},
		{&httplimit.IPOpts{TrustedProxyCount: -1},
			"httplimit: ClientIP: set IPOpts.TrustedProxyCount to the number of proxies that append to X-Forwarded-For, or 0 to find the client by TrustedProxies (got -1)"},
		{&httplimit.IPOpts{Header: "X-Real-IP", TrustedProxyCount: 1},
			"httplimit: ClientIP: set IPOpts.TrustedProxies to the networks of your proxies instead of TrustedProxyCount (1): X-Real-IP holds one address, not one per proxy"},
		{&httplimit.IPOpts{Header: "Forwarded"},
			`httplimit: ClientIP: set IPOpts.TrustedProxies (or TrustedProxyCount) too: without a trusted proxy IPOpts.Header "Forwarded" is never read and the key is RemoteAddr`},
	} {
		require.PanicsWithValue(t, c.want, func() { httplimit.ClientIP(c.opts) }, "step %d", i)
	}
}

// TestClientIPUnixSocketPeer: a peer that is not an IP (a proxy on a Unix socket: RemoteAddr "@")
// gives no key where the key would be the peer or the peer must be a trusted network, but behind
// TrustedProxyCount alone any peer is trusted (docs/spec.md §11): its header is read.
func TestClientIPUnixSocketPeer(t *testing.T) {
	t.Parallel()
	req := func(xff string) *http.Request {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = "@"
		if xff != "" {
			r.Header.Set("X-Forwarded-For", xff)
		}
		return r
	}
	count := httplimit.ClientIP(&httplimit.IPOpts{TrustedProxyCount: 1})
	k, err := count(req("198.51.100.7"))
	require.NoError(t, err)
	require.Equal(t, "198.51.100.7", k)
	_, err = count(req("")) // the proxy's own request: the key would be the peer
	require.ErrorIs(t, err, httplimit.ErrNoKey)
	_, err = httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: prefixes("10.0.0.0/8")})(req("198.51.100.7"))
	require.ErrorIs(t, err, httplimit.ErrNoKey, "a Unix peer is in no trusted network")
}

// TestClientIPMappedTrustedProxies: a trusted network written as IPv4-mapped IPv6 is its IPv4
// network, for the peer as for the header's hops (both are compared as IPv4).
func TestClientIPMappedTrustedProxies(t *testing.T) {
	t.Parallel()
	key := httplimit.ClientIP(&httplimit.IPOpts{TrustedProxies: prefixes("::ffff:10.0.0.0/104", "192.0.2.0/24")})
	for _, c := range []struct{ remote, xff, want string }{
		{"192.0.2.1:1234", "198.51.100.7, 10.0.0.2", "198.51.100.7"}, // a mapped-network hop is skipped
		{"10.0.0.1:1234", "198.51.100.7", "198.51.100.7"},            // a peer in it is trusted
		{"[::ffff:10.0.0.1]:1234", "198.51.100.7", "198.51.100.7"},   // in either spelling
		{"203.0.113.9:1234", "198.51.100.7", "203.0.113.9"},          // an untrusted peer is the key
	} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = c.remote
		r.Header.Set("X-Forwarded-For", c.xff)
		k, err := key(r)
		require.NoError(t, err, c.remote)
		require.Equal(t, c.want, k, "peer %s, X-Forwarded-For %q", c.remote, c.xff)
	}
}

// ClientIP needs one entry of the forwarding header (the TrustedProxyCount-th from the right, or
// the right-most untrusted one), and must not parse every entry of every line to find it
// (realclientip's strategies do, at an allocation or more each). The header is the client's to
// fill: behind TrustedProxyCount alone any peer's header is read, and a proxy passes on what the
// client sent before its own entry. Parsed whole, one request with a 1 MB X-Forwarded-For (Go's
// default MaxHeaderBytes) costs about a million allocations and some 0.3 s of CPU to find an
// address at its right end. Counted in allocations, which do not depend on the machine's speed.
// Not parallel: testing.AllocsPerRun refuses to run in a parallel test.
func TestClientIPWorkIsBoundedByWhatItReads(t *testing.T) {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "10.0.0.1:1234"
	r.Header.Set("X-Forwarded-For", strings.Repeat(",", 1<<19)+"198.51.100.7") // 512 KiB of empty entries, then the client
	for _, c := range []struct {
		name string
		opts *httplimit.IPOpts
	}{
		{"TrustedProxyCount", &httplimit.IPOpts{TrustedProxyCount: 1}},
		{"TrustedProxies", &httplimit.IPOpts{TrustedProxies: prefixes("10.0.0.0/8")}},
	} {
		key := httplimit.ClientIP(c.opts)
		k, err := key(r)
		require.NoError(t, err, c.name)
		require.Equal(t, "198.51.100.7", k, c.name)
		allocs := testing.AllocsPerRun(1, func() { _, _ = key(r) })
		require.Less(t, allocs, 1000.0, "%s: %.0f allocations to read the right-most entry of one header", c.name, allocs)
	}
}

// A key is read on every request: it costs the key string alone, not the error of a request that
// has none (the error for a RemoteAddr that is not an IP was formatted for every request).
// Not parallel: testing.AllocsPerRun refuses to run in a parallel test.
func TestClientIPAllocatesOnlyItsKey(t *testing.T) {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "198.51.100.1:1234"
	key := httplimit.ClientIP(nil)
	k, err := key(r)
	require.NoError(t, err)
	require.Equal(t, "198.51.100.1", k)
	require.Equal(t, 1.0, testing.AllocsPerRun(100, func() { _, _ = key(r) }))
}

// ClientIP reads the header from the right, one entry at a time; its answer is the one
// realclientip's strategies give on the whole header, for any mix of entries and lines.
func TestClientIPAgreesWithWholeHeaderStrategies(t *testing.T) {
	t.Parallel()
	trusted := []string{"10.0.0.0/8", "fd00::/8"}
	nets, err := realclientip.AddressesAndRangesToIPNets(trusted...)
	require.NoError(t, err)
	entries := map[string][]string{
		"X-Forwarded-For": {"198.51.100.7", " 203.0.113.9 ", "10.0.0.2", "10.1.2.3:80", "[2001:db8::1]:443", "2001:db8::2",
			"fd00::1", "::ffff:10.0.0.9", "::ffff:198.51.100.8", "unknown", "", " ", "0.0.0.0", "::", "fe80::1%eth0",
			"10.0.0.3%eth0", "198.51.100.9%eth0", "[10.0.0.4]", "[fd00::5]:80"},
		"Forwarded": {"for=198.51.100.7", `For="[2001:db8::1]:4711";proto=https`, "for=10.0.0.2;by=10.0.0.1", "for=unknown",
			"proto=http", "for=10.0.0.2=x", `for="10.0.0.5"`, "by=192.0.2.1; for=198.51.100.3", "", "for=_hidden",
			`for="[fd00::7]"`, "for=203.0.113.4:80"},
	}
	rnd := rand.New(rand.NewPCG(1, 2))
	for header, pool := range entries {
		for _, count := range []int{0, 1, 2, 3} {
			opts := &httplimit.IPOpts{Header: header, TrustedProxies: prefixes(trusted...), TrustedProxyCount: count}
			key := httplimit.ClientIP(opts)
			var whole realclientip.Strategy
			if count > 0 {
				whole, err = realclientip.NewRightmostTrustedCountStrategy(header, count)
			} else {
				whole, err = realclientip.NewRightmostTrustedRangeStrategy(header, nets)
			}
			require.NoError(t, err)
			for i := range 2000 {
				r := httptest.NewRequest(http.MethodGet, "/", nil)
				r.RemoteAddr = "10.0.0.1:1234"
				for range 1 + rnd.IntN(3) {
					line := make([]string, rnd.IntN(5))
					for j := range line {
						line[j] = pool[rnd.IntN(len(pool))]
					}
					r.Header.Add(header, strings.Join(line, []string{",", ", "}[rnd.IntN(2)]))
				}
				got, err := key(r)
				want, ok := netip.Addr{}, false
				if s := whole.ClientIP(r.Header, r.RemoteAddr); s != "" {
					if a, perr := netip.ParseAddr(s); perr == nil {
						want, ok = a.Unmap().WithZone(""), true
					}
				}
				if !ok {
					require.ErrorIs(t, err, httplimit.ErrNoKey, "%s count %d step %d: %q gave %q", header, count, i, r.Header[header], got)
					continue
				}
				require.NoError(t, err, "%s count %d step %d: %q", header, count, i, r.Header[header])
				wantKey := want.String()
				if want.Is6() {
					wantKey = netip.PrefixFrom(want, 64).Masked().String()
				}
				require.Equal(t, wantKey, got, "%s count %d step %d: %q", header, count, i, r.Header[header])
			}
		}
	}
}
