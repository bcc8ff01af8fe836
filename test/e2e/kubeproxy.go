package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// kube-proxy's rules in the node, written as kube-proxy writes them in its iptables and nftables
// modes (kubernetes' pkg/proxy/iptables and pkg/proxy/nftables proxiers: their chains, rules,
// comments and chain names), for Services whose endpoint is a pod of this node. They are what a
// kube-proxy does to the traffic of the datapath's world without an API server: DNAT of ClusterIPs,
// NodePorts and external and load-balancer IPs, the masquerade of external clients under the
// Cluster traffic policy (the mark 0x4000), and the conntrack that comes with them.

// ProxyMode is the mode of the node's kube-proxy.
type ProxyMode string

const (
	ProxyIptables ProxyMode = "iptables"
	ProxyNftables ProxyMode = "nftables"
)

// ProxyModes are the modes a test runs its Services under.
func ProxyModes() []ProxyMode { return []ProxyMode{ProxyIptables, ProxyNftables} }

// kubeProxyMark is kube-proxy's masquerade mark (--iptables-masquerade-bit 14).
const kubeProxyMark = "0x4000"

// Service is one port of a Service with a single endpoint, a pod of this node.
type Service struct {
	Namespace, Name, PortName string
	Proto                     string // "tcp" or "udp"
	ClusterIP                 netip.Addr
	Port, NodePort            uint16
	// ExternalIPs are spec.externalIPs, LoadBalancerIPs status.loadBalancer.ingress: addresses
	// routed to the node that it does not own.
	ExternalIPs, LoadBalancerIPs []netip.Addr
	// Local is externalTrafficPolicy Local: external clients reach the endpoint with their own
	// address. Under Cluster (false) kube-proxy masquerades them.
	Local    bool
	Endpoint netip.AddrPort
}

func (s Service) family() policy.Family { return policy.FamilyOf(s.ClusterIP) }

// portName is kube-proxy's ServicePortName: "ns/name:port".
func (s Service) portName() string { return s.Namespace + "/" + s.Name + ":" + s.PortName }

// hash16 is kube-proxy's iptables chain hash: base32 of sha256, 16 characters.
func hash16(parts ...string) string {
	h := sha256.Sum256([]byte(strings.Join(parts, "")))
	return base32.StdEncoding.EncodeToString(h[:])[:16]
}

// InstallServices writes the rules of svcs into the node as a kube-proxy in mode would (in
// iptables mode with the iptables variant ipt), both families.
func InstallServices(ctx context.Context, t testing.TB, env *Env, mode ProxyMode, ipt iptables.Mode, svcs []Service) {
	t.Helper()
	for _, fam := range policy.Families() {
		var these []Service
		for _, s := range svcs {
			if s.family() == fam {
				these = append(these, s)
			}
		}
		var err error
		if mode == ProxyNftables {
			_, err = NSExec(ctx, env.Node, nftScript(fam, these), "nft", "-f", "-")
		} else {
			tool := "iptables-" + string(ipt) + "-restore"
			if fam == policy.IPv6 {
				tool = "ip6tables-" + string(ipt) + "-restore"
			}
			_, err = NSExec(ctx, env.Node, iptablesPayload(fam, these), tool, "--noflush")
		}
		if err != nil {
			t.Fatalf("kube-proxy %s rules (%s): %v", mode, fam, err)
		}
	}
}

// podCIDR is kube-proxy's --cluster-cidr of a family (local traffic detection by CIDR).
func podCIDR(fam policy.Family) netip.Prefix {
	if fam == policy.IPv6 {
		return PodNet6
	}
	return PodNet4
}

// iptablesPayload is an iptables-restore --noflush payload of kube-proxy's iptables mode for
// svcs: its filter rules for forwarding, then its nat chains and the jumps to them.
func iptablesPayload(fam policy.Family, svcs []Service) string {
	var b strings.Builder
	b.WriteString(`*filter
:KUBE-FORWARD - [0:0]
-I FORWARD 1 -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
`)
	var rules strings.Builder
	for _, s := range svcs {
		s.iptablesChains(&b, &rules, fam)
	}
	b.WriteString(`-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --or-mark ` + kubeProxyMark + `
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark ` + kubeProxyMark + `
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
`)
	b.WriteString(rules.String())
	b.WriteString(`-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
`)
	return b.String()
}

// iptablesChains declares s's chains in chains and writes its rules to rules.
func (s Service) iptablesChains(chains, rules *strings.Builder, fam policy.Family) {
	name, proto := s.portName(), s.Proto
	hash := hash16(name, proto)
	svc, ext, svl := "KUBE-SVC-"+hash, "KUBE-EXT-"+hash, "KUBE-SVL-"+hash
	sep := "KUBE-SEP-" + hash16(name, proto, s.Endpoint.String())
	for _, c := range []string{svc, ext, sep} {
		fmt.Fprintf(chains, ":%s - [0:0]\n", c)
	}
	match := "-m " + proto + " -p " + proto
	add := func(chain, format string, args ...any) {
		fmt.Fprintf(rules, "-A %s %s\n", chain, fmt.Sprintf(format, args...))
	}
	add("KUBE-SERVICES", `-m comment --comment "%s cluster IP" %s -d %s --dport %d -j %s`, name, match, s.ClusterIP, s.Port, svc)
	for _, a := range s.ExternalIPs {
		add("KUBE-SERVICES", `-m comment --comment "%s external IP" %s -d %s --dport %d -j %s`, name, match, a, s.Port, ext)
	}
	for _, a := range s.LoadBalancerIPs {
		add("KUBE-SERVICES", `-m comment --comment "%s loadbalancer IP" %s -d %s --dport %d -j %s`, name, match, a, s.Port, ext)
	}
	if s.NodePort != 0 {
		add("KUBE-NODEPORTS", `-m comment --comment %s %s --dport %d -j %s`, name, match, s.NodePort, ext)
	}
	add(svc, `-m comment --comment "%s cluster IP" %s -d %s --dport %d ! -s %s -j KUBE-MARK-MASQ`, name, match, s.ClusterIP, s.Port, podCIDR(fam))
	add(svc, `-m comment --comment "%s -> %s" -j %s`, name, s.Endpoint, sep)
	if s.Local {
		fmt.Fprintf(chains, ":%s - [0:0]\n", svl)
		add(ext, `-m comment --comment "pod traffic for %s external destinations" -s %s -j %s`, name, podCIDR(fam), svc)
		add(ext, `-m comment --comment "masquerade LOCAL traffic for %s external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ`, name)
		add(ext, `-m comment --comment "route LOCAL traffic for %s external destinations" -m addrtype --src-type LOCAL -j %s`, name, svc)
		add(ext, `-j %s`, svl)
		add(svl, `-m comment --comment "%s -> %s" -j %s`, name, s.Endpoint, sep)
	} else {
		add(ext, `-m comment --comment "masquerade traffic for %s external destinations" -j KUBE-MARK-MASQ`, name)
		add(ext, `-j %s`, svc)
	}
	add(sep, `-m comment --comment %s -s %s -j KUBE-MARK-MASQ`, name, s.Endpoint.Addr())
	add(sep, `-m comment --comment %s %s -j DNAT --to-destination %s`, name, match, s.Endpoint)
}

// nftScript is an nft script of kube-proxy's nftables mode for svcs, in the family's table
// (nftables.KubeProxyTable): its base chains, sets and maps, then each Service's chains and
// elements.
func nftScript(fam policy.Family, svcs []Service) string {
	ip, addrType := "ip", "ipv4_addr"
	if fam == policy.IPv6 {
		ip, addrType = "ip6", "ipv6_addr"
	}
	t := ip + " " + nftables.KubeProxyTable
	var b strings.Builder
	fmt.Fprintf(&b, `add table %[1]s { comment "rules for kube-proxy" ; }
add set %[1]s cluster-ips { type %[2]s ; comment "Active ClusterIPs" ; }
add set %[1]s nodeport-ips { type %[2]s ; comment "IPs that accept NodePort traffic" ; }
add map %[1]s service-ips { type %[2]s . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }
add map %[1]s service-nodeports { type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }
add chain %[1]s mark-for-masquerade
add chain %[1]s masquerading
add chain %[1]s nat-output { type nat hook output priority -100 ; }
add chain %[1]s nat-postrouting { type nat hook postrouting priority 100 ; }
add chain %[1]s nat-prerouting { type nat hook prerouting priority -100 ; }
add chain %[1]s services
add rule %[1]s mark-for-masquerade mark set mark or %[3]s
add rule %[1]s masquerading mark and %[3]s == 0 return
add rule %[1]s masquerading mark set mark xor %[3]s
add rule %[1]s masquerading masquerade fully-random
add rule %[1]s nat-output jump services
add rule %[1]s nat-postrouting jump masquerading
add rule %[1]s nat-prerouting jump services
add rule %[1]s services %[4]s daddr . meta l4proto . th dport vmap @service-ips
add rule %[1]s services %[4]s daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports
add element %[1]s nodeport-ips { %[5]s }
`, t, addrType, kubeProxyMark, ip, NodeAddr(fam))
	for _, s := range svcs {
		s.nftChains(&b, t, ip)
	}
	return b.String()
}

// nftChainBase is kube-proxy's nftables chain name suffix: a hash, then the readable name
// ("ULMVA6XW-ns1/svc1/tcp/p80"), the endpoint's after "__" with an IPv6 address's colons as dots.
func nftChainBase(parts ...string) string {
	name := strings.Join(parts, "/")
	h := sha256.Sum256([]byte(name))
	return base32.StdEncoding.EncodeToString(h[:])[:8] + "-" + name
}

// nftChains writes s's chains, rules and elements into table t (ip: "ip" or "ip6").
func (s Service) nftChains(b *strings.Builder, t, ip string) {
	base := nftChainBase(s.Namespace, s.Name, s.Proto, s.PortName)
	epAddr := strings.ReplaceAll(s.Endpoint.Addr().String(), ":", ".")
	ep := "endpoint-" + nftChainBase(s.Namespace, s.Name, s.Proto, s.PortName+"__"+epAddr, strconv.Itoa(int(s.Endpoint.Port())))
	svc, ext, local := "service-"+base, "external-"+base, "local-"+base
	line := func(format string, args ...any) { fmt.Fprintf(b, format+"\n", args...) }
	chains := []string{svc, ext, ep}
	if s.Local {
		chains = append(chains, local)
	}
	for _, c := range chains {
		line("add chain %s %s", t, c)
	}
	line("add rule %s %s %s daddr %s %s saddr != %s jump mark-for-masquerade", t, svc, ip, s.ClusterIP, ip, podCIDR(s.family()))
	line("add rule %s %s numgen random mod 1 vmap { 0 : goto %s }", t, svc, ep)
	if s.Local {
		line("add rule %s %s numgen random mod 1 vmap { 0 : goto %s }", t, local, ep)
		line(`add rule %s %s %s saddr %s goto %s comment "short-circuit pod traffic"`, t, ext, ip, podCIDR(s.family()), svc)
		line(`add rule %s %s fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"`, t, ext)
		line(`add rule %s %s fib saddr type local goto %s comment "short-circuit local traffic"`, t, ext, svc)
		line("add rule %s %s goto %s", t, ext, local)
	} else {
		line("add rule %s %s jump mark-for-masquerade", t, ext)
		line("add rule %s %s goto %s", t, ext, svc)
	}
	line("add rule %s %s %s saddr %s jump mark-for-masquerade", t, ep, ip, s.Endpoint.Addr())
	line("add rule %s %s meta l4proto %s dnat to %s", t, ep, s.Proto, s.Endpoint)
	line("add element %s cluster-ips { %s }", t, s.ClusterIP)
	line("add element %s service-ips { %s . %s . %d : goto %s }", t, s.ClusterIP, s.Proto, s.Port, svc)
	for _, a := range append(append([]netip.Addr(nil), s.ExternalIPs...), s.LoadBalancerIPs...) {
		line("add element %s service-ips { %s . %s . %d : goto %s }", t, a, s.Proto, s.Port, ext)
	}
	if s.NodePort != 0 {
		line("add element %s service-nodeports { %s . %d : goto %s }", t, s.Proto, s.NodePort, ext)
	}
}
