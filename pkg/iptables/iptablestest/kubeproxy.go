package iptablestest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
)

// KubeProxyNAT returns an iptables-restore payload (for --noflush) that fills the nat table the
// way kube-proxy's iptables mode does on a real node, with at least n rules: KUBE-SERVICES
// matching each service's cluster IP, a KUBE-SVC-* chain per service spreading over three
// endpoints with -m statistic, and a KUBE-SEP-* chain per endpoint that marks hairpin traffic
// and DNATs, plus KUBE-POSTROUTING's MASQUERADE of marked packets. About 11 rules and 4 chains per
// service: 20,000 rules are 1,819 services in 7,280 chains.
func KubeProxyNAT(n int) []byte {
	var chains, rules []string
	rules = append(rules,
		`-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`,
		`-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`,
		`-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING`,
		`-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000`,
		`-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN`,
		`-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0`,
		`-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully`)
	hash := func(s string) string {
		h := sha256.Sum256([]byte(s))
		return strings.ToUpper(hex.EncodeToString(h[:8]))
	}
	for s := 0; len(rules) < n-1; s++ {
		svc := "KUBE-SVC-" + hash(fmt.Sprint(s))
		chains = append(chains, svc)
		ip := fmt.Sprintf("10.96.%d.%d", s/250%256, s%250+1)
		name := fmt.Sprintf("ns%d/svc%d:http", s%50, s)
		rules = append(rules,
			fmt.Sprintf(`-A KUBE-SERVICES -d %s/32 -p tcp -m comment --comment "%s cluster IP" -m tcp --dport 80 -j %s`, ip, name, svc),
			fmt.Sprintf(`-A %s ! -s 10.244.0.0/16 -d %s/32 -p tcp -m comment --comment "%s cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ`, svc, ip, name))
		const endpoints = 3
		for e := range endpoints {
			sep := "KUBE-SEP-" + hash(fmt.Sprintf("%d-%d", s, e))
			chains = append(chains, sep)
			i := s*endpoints + e
			ep := fmt.Sprintf("10.244.%d.%d", i/250%256, i%250+1)
			if e < endpoints-1 {
				rules = append(rules, fmt.Sprintf(`-A %s -m comment --comment "%s -> %s:8080" -m statistic --mode random --probability %.11f -j %s`,
					svc, name, ep, 1/float64(endpoints-e), sep))
			} else {
				rules = append(rules, fmt.Sprintf(`-A %s -m comment --comment "%s -> %s:8080" -j %s`, svc, name, ep, sep))
			}
			rules = append(rules,
				fmt.Sprintf(`-A %s -s %s/32 -m comment --comment "%s" -j KUBE-MARK-MASQ`, sep, ep, name),
				fmt.Sprintf(`-A %s -p tcp -m comment --comment "%s" -m tcp -j DNAT --to-destination %s:8080`, sep, name, ep))
		}
	}
	rules = append(rules, `-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS`)
	var b strings.Builder
	b.WriteString("*nat\n")
	for _, c := range append([]string{"KUBE-SERVICES", "KUBE-MARK-MASQ", "KUBE-POSTROUTING", "KUBE-NODEPORTS"}, chains...) {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	for _, r := range rules {
		b.WriteString(r + "\n")
	}
	b.WriteString("COMMIT\n")
	return []byte(b.String())
}
