package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Services of a node whose kube-proxy DNATs them to a local pod (kubeproxy.go): addresses the
// node does not own (load-balancer and external IPs, routed to it by the external host), its
// NodePorts, and a pod reaching its own Service (hairpin). Conntrack knows the replies of the
// DNAT'd connections; the datapath must leave them as they are.

var (
	// lbAddr and extIPAddr are a Service's load-balancer and external IP, per family: routed to
	// the node by the external host, on no device of the node.
	lbAddr4, lbAddr6       = netip.MustParseAddr("198.51.100.80"), netip.MustParseAddr("2001:db8:80::80")
	extIPAddr4, extIPAddr6 = netip.MustParseAddr("203.0.113.80"), netip.MustParseAddr("2001:db8:81::80")
	clusterIP4, clusterIP6 = netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00:10:96::10")
	// returnClient4 and returnClient6 are external clients the policy of keepLocalConfig leaves
	// alone; public4 and public6 are clients it masquerades.
	returnClient4, returnClient6 = netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("fd00::1")
)

// servicePort and nodePort of the Services; a Local policy's are one higher.
const (
	servicePort = 80
	nodePort    = 30080
)

// testServices are one Service per family, protocol and external traffic policy, each with a
// load-balancer IP, an external IP and a NodePort, its endpoint the pod's line echo server.
func testServices() []Service {
	var out []Service
	for _, fam := range policy.Families() {
		lb, ext, cip := lbAddr4, extIPAddr4, clusterIP4
		if fam == policy.IPv6 {
			lb, ext, cip = lbAddr6, extIPAddr6, clusterIP6
		}
		for _, proto := range []string{"tcp", "udp"} {
			for _, local := range []bool{false, true} {
				name, offset := "cluster", uint16(0)
				if local {
					name, offset = "local", 1
				}
				out = append(out, Service{Namespace: "e2e", Name: name + "-" + fam.String(), PortName: "p" + proto,
					Proto: proto, ClusterIP: cip, Port: servicePort + offset, NodePort: nodePort + offset,
					ExternalIPs: []netip.Addr{ext}, LoadBalancerIPs: []netip.Addr{lb}, Local: local,
					Endpoint: netip.AddrPortFrom(PodAddr(fam), LinePort)})
			}
		}
	}
	return out
}

// routeServices makes the external host route the Services' outside addresses to the node.
func routeServices(ctx context.Context, t testing.TB, env *Env) {
	t.Helper()
	if err := testutil.IPBatch(ctx, env.Ext, fmt.Sprintf(`route add %s/32 via %s
route add %s/32 via %s
route add %s/128 via %s
route add %s/128 via %s
`, lbAddr4, NodeAddr4, extIPAddr4, NodeAddr4, lbAddr6, NodeAddr6, extIPAddr6, NodeAddr6)); err != nil {
		t.Fatalf("routes to the Services: %v", err)
	}
}

// eachBackendAndProxy runs body for every backend under every kube-proxy mode, each in a node
// of its own that has the mode's rules for testServices and the external host's routes to them.
func eachBackendAndProxy(t *testing.T, flags []string, body func(ctx context.Context, t *testing.T, b Backend, env *Env)) {
	t.Helper()
	for _, b := range backends() {
		for _, mode := range ProxyModes() {
			t.Run(b.Name+"/kube-proxy-"+string(mode), func(t *testing.T) {
				t.Parallel()
				requireBackend(t, b)
				ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
				defer cancel()
				env := NewBackendEnv(ctx, t, b, flags)
				InstallServices(ctx, t, env, mode, b.Iptables, testServices())
				routeServices(ctx, t, env)
				body(ctx, t, b, env)
			})
		}
	}
}

// serviceProbes are the probes of one family: external clients the policy masquerades and
// ones it leaves alone to both outside addresses of both policies' Services, a masqueraded
// client to both NodePorts, and the pod to its own Services (hairpin) by each address kind.
func serviceProbes(env *Env, fam policy.Family) []connProbe {
	lb, ext, cip, masqClient, returnClient, gw := lbAddr4, extIPAddr4, clusterIP4, public4, returnClient4, PodGW4
	if fam == policy.IPv6 {
		lb, ext, cip, masqClient, returnClient, gw = lbAddr6, extIPAddr6, clusterIP6, public6, returnClient6, PodGW6
	}
	kubeProxyMasq := func(netip.AddrPort) netip.Addr { return gw }
	client := func(l netip.AddrPort) netip.Addr { return l.Addr().Unmap() }
	var out []connProbe
	for _, local := range []bool{false, true} {
		policyName, offset, want := "Cluster", uint16(0), kubeProxyMasq
		if local {
			policyName, offset, want = "Local", 1, client
		}
		for _, c := range []netip.Addr{masqClient, returnClient} {
			for _, a := range []netip.Addr{lb, ext} {
				out = append(out, connProbe{what: fmt.Sprintf("%s -> %s (%s)", c, a, policyName), ns: env.Ext,
					from: c, dst: netip.AddrPortFrom(a, servicePort+offset), want: want})
			}
		}
		out = append(out, connProbe{what: fmt.Sprintf("%s -> NodePort %d (%s)", masqClient, nodePort+offset, policyName),
			ns: env.Ext, from: masqClient, dst: netip.AddrPortFrom(NodeAddr(fam), nodePort+offset), want: want})
	}
	for _, a := range []netip.AddrPort{netip.AddrPortFrom(lb, servicePort), netip.AddrPortFrom(cip, servicePort),
		netip.AddrPortFrom(NodeAddr(fam), nodePort)} {
		out = append(out, connProbe{what: "the pod to its own Service at " + a.String(), ns: env.Pod,
			from: PodAddr(fam), dst: a, want: kubeProxyMasq})
	}
	return out
}

// TestServicesOnOutsideAddresses: with kube-proxy's rules (iptables and nftables mode) DNATing a
// load-balancer IP and an external IP that are routed to the node but not on it to a local pod,
// clients the policy masquerades and clients it leaves alone reach the pod and get its answers
// from the Service's address, over TCP and UDP, IPv4 and IPv6, with kube-proxy masquerading them
// (externalTrafficPolicy Cluster) or not (Local); NodePorts and a pod reaching its own Service
// keep working.
func TestServicesOnOutsideAddresses(t *testing.T) {
	eachBackendAndProxy(t, []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReady(ctx, t, b, keepLocalConfig)
		StartLineEcho(t, env.Pod, []netip.Addr{PodAddr4, PodAddr6})
		var failed []string
		for _, fam := range policy.Families() {
			for _, p := range serviceProbes(env, fam) {
				for _, proto := range []string{"tcp", "udp"} {
					if msg := p.run(ctx, proto); msg != "" {
						failed = append(failed, proto+" "+msg)
					}
				}
			}
		}
		if len(failed) > 0 {
			t.Errorf("%d Service probes failed:\n%s", len(failed), strings.Join(failed, "\n"))
		}
	})
}
