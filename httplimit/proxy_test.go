package httplimit_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txlimit/txlimit/httplimit"
	"github.com/txlimit/txlimit/ratelimit"
)

// Addresses on loopback (Linux routes all of 127.0.0.0/8 to lo): every hop has one of its own,
// listens on it and connects onward from it, so that the next hop sees it as RemoteAddr.
const (
	cdnIP   = "127.0.0.2" // the proxy facing the clients in the chain
	proxyIP = "127.0.0.3" // the proxy facing the server
)

// The real clients: each must be counted against its own address, whatever it sends.
var clientIPs = []string{"127.0.0.10", "127.0.0.11"}

// spoofs are the forwarding headers a client sends to choose its key: other addresses, the
// trusted proxies' addresses, several lines, all three headers at once.
var spoofs = [][]string{
	nil,
	{"X-Forwarded-For", "203.0.113.1"},
	{"X-Forwarded-For", "203.0.113.2, " + cdnIP + ", " + proxyIP},
	{"X-Forwarded-For", "203.0.113.3", "X-Forwarded-For", proxyIP},
	{"Forwarded", "for=203.0.113.4"},
	{"Forwarded", `for=203.0.113.5, for="` + proxyIP + `"`},
	{"X-Real-IP", "203.0.113.6"},
	{"X-Real-IP", proxyIP},
	{"X-Forwarded-For", "203.0.113.7", "Forwarded", "for=203.0.113.8", "X-Real-IP", "203.0.113.9"},
}

// dialFrom returns a Transport whose connections come from the loopback address ip.
func dialFrom(ip string) *http.Transport {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 10 * time.Second}
	return &http.Transport{DialContext: d.DialContext}
}

// listenOn starts h on the loopback address ip, or skips the test where that is not possible
// (macOS has only 127.0.0.1 unless aliases are added).
func listenOn(t *testing.T, ip string, h http.Handler) *url.URL {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Skipf("listen on %s: %v (this test needs distinct loopback addresses, as Linux has)", ip, err)
	}
	srv := httptest.NewUnstartedServer(h)
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	u, err := url.Parse(srv.URL)
	require.NoError(t, err)
	return u
}

// forElem is the Forwarded element naming the peer remoteAddr (RFC 7239: IPv6 quoted, bracketed).
func forElem(remoteAddr string) string {
	host, _, _ := net.SplitHostPort(remoteAddr)
	if strings.Contains(host, ":") {
		return `for="[` + host + `]"`
	}
	return "for=" + host
}

// appendForwarded appends forElem(remoteAddr) to the Forwarded lines prior, as one line.
func appendForwarded(h http.Header, prior []string, remoteAddr string) {
	h.Set("Forwarded", strings.Join(append(append([]string(nil), prior...), forElem(remoteAddr)), ", "))
}

// proxy is an httputil.ReverseProxy on ip, forwarding to target, that writes header the way a
// proxy configured for it would: first is the proxy facing the clients.
//   - Director style (Go's original API): X-Forwarded-For is appended by ReverseProxy itself;
//     Forwarded is appended to what arrived (which a Director passes on); X-Real-IP is set by
//     the first proxy and passed on by the next.
//   - Rewrite style: ReverseProxy removes Forwarded and X-Forwarded-For before Rewrite runs.
//     The first proxy writes them afresh (SetXForwarded; a Forwarded of its own); the next copies
//     what arrived and appends (as SetXForwarded's doc shows); X-Real-IP as with a Director.
func proxy(t *testing.T, ip string, target *url.URL, style, header string, first bool) *url.URL {
	t.Helper()
	rp := &httputil.ReverseProxy{Transport: dialFrom(ip)}
	switch style {
	case "Director":
		//lint:ignore SA1019 plays proxies that still use Director (deprecated since Go 1.26, in use)
		rp.Director = func(r *http.Request) { // r is the outbound request, with the inbound RemoteAddr
			r.URL.Scheme, r.URL.Host, r.Host = target.Scheme, target.Host, ""
			switch {
			case header == "Forwarded":
				appendForwarded(r.Header, r.Header.Values("Forwarded"), r.RemoteAddr)
			case header == "X-Real-IP" && first:
				host, _, _ := net.SplitHostPort(r.RemoteAddr)
				r.Header.Set("X-Real-IP", host)
			}
		}
	case "Rewrite":
		rp.Rewrite = func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			switch {
			case header == "X-Forwarded-For":
				if !first {
					pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
				}
				pr.SetXForwarded()
			case header == "Forwarded" && first:
				appendForwarded(pr.Out.Header, nil, pr.In.RemoteAddr)
			case header == "Forwarded":
				appendForwarded(pr.Out.Header, pr.In.Header.Values("Forwarded"), pr.In.RemoteAddr)
			case header == "X-Real-IP" && first:
				host, _, _ := net.SplitHostPort(pr.In.RemoteAddr)
				pr.Out.Header.Set("X-Real-IP", host)
			}
		}
	default:
		t.Fatalf("unknown style %q", style)
	}
	rp.ErrorHandler = func(w http.ResponseWriter, r *http.Request, err error) {
		t.Errorf("proxy %s: %v", ip, err)
		w.WriteHeader(http.StatusBadGateway)
	}
	t.Cleanup(rp.Transport.(*http.Transport).CloseIdleConnections)
	return listenOn(t, ip, rp)
}

// Issue 31, item 1: through real httputil.ReverseProxy hops on loopback, one proxy or a CDN in
// front of a proxy, in Director and Rewrite style, for the default header and each option, and
// with the proxies trusted by network, by count, or both: whatever forwarding headers a client
// sends, it is counted against its own address. Each response's RateLimit field shows the key
// charged (pk) and that every one of the client's requests went to that key (r counts down by
// one); the handler echoes the key ClientIP found.
func TestClientIPThroughReverseProxies(t *testing.T) {
	t.Parallel()
	b := setup(t, fixed)
	clients := make(map[string]*http.Client, len(clientIPs))
	for _, ip := range clientIPs {
		tr := dialFrom(ip)
		t.Cleanup(tr.CloseIdleConnections)
		clients[ip] = &http.Client{Transport: tr}
	}
	type trust struct {
		name    string
		opts    func(header string, hops []string) *httplimit.IPOpts
		direct  bool // a client reaching the server directly is keyed by its own address
		headers []string
	}
	trusts := []trust{
		{"networks", func(header string, hops []string) *httplimit.IPOpts {
			return &httplimit.IPOpts{Header: header, TrustedProxies: prefixes(hostPrefixes(hops)...)}
		}, true, []string{"X-Forwarded-For", "Forwarded", "X-Real-IP"}},
		{"count", func(header string, hops []string) *httplimit.IPOpts {
			return &httplimit.IPOpts{Header: header, TrustedProxyCount: len(hops)}
		}, false, []string{"X-Forwarded-For", "Forwarded"}},
		{"count behind the proxy's network", func(header string, hops []string) *httplimit.IPOpts {
			return &httplimit.IPOpts{Header: header, TrustedProxyCount: len(hops), TrustedProxies: prefixes(proxyIP + "/32")}
		}, true, []string{"X-Forwarded-For", "Forwarded"}},
	}
	for _, tr := range trusts {
		for _, header := range tr.headers {
			for _, style := range []string{"Director", "Rewrite"} {
				for _, hops := range [][]string{{proxyIP}, {cdnIP, proxyIP}} {
					policy := fmt.Sprintf("%s, %s, %s, %d hop(s)", header, tr.name, style, len(hops))
					t.Run(policy, func(t *testing.T) {
						t.Parallel()
						opts := tr.opts(header, hops)
						if header == "X-Forwarded-For" {
							opts.Header = "" // the default
						}
						key := httplimit.ClientIP(opts)
						m, err := httplimit.New(&httplimit.Config{Decider: httplimit.OnPool(b.limiter, b.pool), Secret: secret,
							Policies: []httplimit.Policy{{Name: policy, Config: ratelimit.Config{Rate: 100, Period: time.Hour}, Key: key}}})
						require.NoError(t, err)
						server := listenOn(t, "127.0.0.1", m.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
							k, err := key(r)
							if err != nil {
								http.Error(w, err.Error(), http.StatusInternalServerError)
								return
							}
							_, _ = io.WriteString(w, k)
						})))
						// Build the chain from the server outwards.
						entry := server
						for i := len(hops) - 1; i >= 0; i-- {
							entry = proxy(t, hops[i], entry, style, header, i == 0)
						}
						charged := map[string]int64{}
						send := func(step int, via *url.URL, client string, spoof []string) {
							t.Helper()
							req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, via.String()+"/", nil)
							require.NoError(t, err)
							for j := 0; j+1 < len(spoof); j += 2 {
								req.Header.Add(spoof[j], spoof[j+1])
							}
							resp, err := clients[client].Do(req)
							require.NoError(t, err)
							body, err := io.ReadAll(resp.Body)
							resp.Body.Close()
							require.NoError(t, err)
							require.Equal(t, http.StatusOK, resp.StatusCode, "step %d: %s", step, body)
							require.Equal(t, client, string(body), "step %d: client %s sent %q", step, client, spoof)
							charged[client]++
							want := fmt.Sprintf(`%q;r=%d;t=36;pk=:%s:`, policy, 100-charged[client], b64(pk(policy, client)))
							require.Equal(t, want, resp.Header.Get("RateLimit"), "step %d: client %s sent %q", step, client, spoof)
						}
						step := 0
						for _, spoof := range spoofs {
							for _, client := range clientIPs {
								send(step, entry, client, spoof)
								step++
								if tr.direct { // bypassing the proxies changes nothing either
									send(step, server, client, spoof)
									step++
								}
							}
						}
					})
				}
			}
		}
	}
}

// hostPrefixes returns ip/32 for each IPv4 address.
func hostPrefixes(ips []string) []string {
	out := make([]string, len(ips))
	for i, ip := range ips {
		out[i] = ip + "/32"
	}
	return out
}
