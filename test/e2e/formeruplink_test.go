package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// The policies of TestFormerUplink: 198.18.0.0/15, which table 100 sends out of uplink2, is
// masqueraded (uplink2 is an uplink by that route), then kept (no route of uplink2 leads where
// the policy masquerades: it is no uplink). uplink2's own subnet is in 10.0.0.0/8.
const (
	formerMasq = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
	formerKeep = "nonMasqueradeCIDRs: [10.0.0.0/8, 198.18.0.0/15]\n"
)

// TestFormerUplink: a TCP connection and a UDP flow masqueraded out of a second uplink (a route
// of table 100 toward a range the policy masquerades) keep their source when a configuration
// change keeps that range, which makes the device no uplink on BPF: conntrack keeps a
// MASQUERADE binding until the connection ends, whatever the rules say now. New connections
// there keep the pod's address. On BPF the device drains: it keeps the programs while those
// flows last (dump and ip_masq_agent_uplink_info say so), and the agent stays ready. When the
// device loses its address, conntrack drops the bindings (nf_nat_masquerade's notifier), and the
// BPF backend detaches and flushes within a sweep; with the address and routes back, new
// connections follow the policy: kept, then masqueraded again once the configuration says so.
func TestFormerUplink(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			requireBackend(t, b)
			ctx, cancel := context.WithTimeout(context.Background(), 2*ScenarioTimeout)
			defer cancel()
			env := NewBackendEnv(ctx, t, b, nil)
			if b.NAT {
				// A former uplink's end is looked for after each sweep.
				env.AgentFlags = append(env.AgentFlags, "--nat-sweep-interval=200ms")
			}
			ag := env.StartReady(ctx, t, b, formerMasq)
			ext2 := env.addSecondUplink(ctx, t)
			StartLineEcho(t, ext2, []netip.Addr{ext2Masq4})
			env.policyRouting(ctx, t, "add", "routes")
			env.policyRouting(ctx, t, "add", "rules")
			// seen probes dst until new connections and datagrams to it are seen from want: the
			// agent follows the routes within a second or so.
			seen := func(when string, dst, want netip.Addr) {
				t.Helper()
				for _, proto := range []string{"tcp", "udp"} {
					if err := testutil.Poll(10*time.Second, 0, func() error {
						if got, err := env.Probe(ctx, proto, dst); err != nil || got.Addr() != want {
							return testutil.NotYet("the host to see %s from %s, saw %s (%v)", proto, want, got, err)
						}
						return nil
					}); err != nil {
						t.Fatalf("%s: %s to %s: %v", when, proto, dst, err)
					}
				}
			}
			configure := func(cfg string) { t.Helper(); reconfigure(ctx, t, env, ag, cfg) }
			dump := func() string {
				t.Helper()
				out, err := NSExec(ctx, env.Node, "", agentBin, append(env.DatapathArgs("dump", b), "--config="+env.Config.Path())...)
				if err != nil {
					t.Fatalf("dump: %v: %s", err, out)
				}
				return string(out)
			}

			seen("table 100 selected", ext2Masq4, uplink2Addr4)
			held := holdFlows(ctx, t, env, ext2Masq4)
			if held.tcpSrc.Addr() != uplink2Addr4 || held.udpSrc.Addr() != uplink2Addr4 {
				t.Fatalf("the held flows are seen from %s (tcp) and %s (udp), want %s", held.tcpSrc, held.udpSrc, uplink2Addr4)
			}

			// The policy keeps 198.18.0.0/15 now: the open flows keep their binding, new ones the
			// pod's address.
			configure(formerKeep)
			held.check(t, "after nonMasqueradeCIDRs took 198.18.0.0/15")
			seen("198.18.0.0/15 kept", ext2Masq4, PodAddr4)
			held.check(t, "after new connections were kept")
			if b.NAT {
				if err := ag.WaitLog(ctx, 1, "a former uplink drains", "uplink2"); err != nil {
					t.Fatal(err)
				}
				if n := ag.Count("a former uplink is left"); n != 0 {
					t.Errorf("%d former uplinks left while the flows of uplink2 are open", n)
				}
				if out := dump(); !strings.Contains(out, "uplink2  ") || !strings.Contains(out, "former uplink, draining") ||
					!strings.Contains(out, " of "+uplink2Addr4.String()+" last") {
					t.Errorf("dump does not list uplink2 as a former uplink that drains:\n%s", out)
				}
				m, err := ag.Scrape(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if v, ok := m.Value("ip_masq_agent_uplink_info", Labels{"device": "uplink2", "via": "former uplink, draining", "covered": "true"}); !ok || v != 1 {
					t.Errorf("uplink_info of uplink2: %v %v, want 1 draining; series %v", v, ok, m.Series("ip_masq_agent_uplink_info", nil))
				}
				want := ourPrograms(strings.TrimPrefix(b.Name, "bpf-"))
				if progs, _ := env.DevicePrograms(t, "uplink2"); !slices.Equal(progs, want) {
					t.Errorf("uplink2 runs %v while it drains, want %v", progs, want)
				}
			}
			if code, body, err := ag.Get(ctx, "/readyz"); err != nil || code != http.StatusOK {
				t.Errorf("/readyz while a former uplink drains: %d %q %v", code, body, err)
			}

			// The address goes: the bindings with it (the kernel takes the device's routes too).
			if err := testutil.IPBatch(ctx, env.Node, "addr del "+uplink2Addr4.String()+"/24 dev uplink2\n"); err != nil {
				t.Fatal(err)
			}
			if b.NAT {
				if err := ag.WaitLog(ctx, 1, "a former uplink is left", "uplink=uplink2", "its SNAT address is gone"); err != nil {
					t.Fatal(err)
				}
				if progs, _ := env.DevicePrograms(t, "uplink2"); len(progs) != 0 {
					t.Errorf("uplink2 still runs %v without its address", progs)
				}
				if out := dump(); strings.Contains(out, "former uplink, draining") {
					t.Errorf("dump after uplink2's address went:\n%s", out)
				}
			}

			// Back, the device takes new connections as the policy says: kept, then, the range
			// masqueraded again, behind its address.
			// The address and the IPv4 routes of table 100 (the IPv6 ones stayed).
			back := "addr add " + uplink2Addr4.String() + "/24 dev uplink2\n"
			for _, r := range routesToSecondUplink {
				if r.dst.Addr().Is4() {
					back += fmt.Sprintf("route add %s via %s dev uplink2 table 100\n", r.dst, r.gw)
				}
			}
			if err := testutil.IPBatch(ctx, env.Node, back); err != nil {
				t.Fatal(err)
			}
			seen("the address back", ext2Masq4, PodAddr4)
			if b.NAT {
				if progs, _ := env.DevicePrograms(t, "uplink2"); len(progs) != 0 {
					t.Errorf("uplink2 runs %v, no uplink and no flow of it open", progs)
				}
			}
			configure(formerMasq)
			seen("198.18.0.0/15 masqueraded again", ext2Masq4, uplink2Addr4)
		})
	}
}

// reconfigure writes cfg and waits until the agent applied it.
func reconfigure(ctx context.Context, t *testing.T, env *Env, ag *Agent, cfg string) {
	t.Helper()
	applied := ag.Count("trigger=config-change", "policy applied")
	if err := env.Config.Write(cfg); err != nil {
		t.Fatal(err)
	}
	if err := ag.WaitLog(ctx, applied+1, "trigger=config-change", "policy applied"); err != nil {
		t.Fatal(err)
	}
	env.SetGood(cfg, false)
}

// TestFormerUplinkPods: where the policy masquerades toward the pods, the pods' device is one
// pod traffic leaves by (an uplink on BPF: TestMasqueradedTowardPods); a reload that keeps the
// pods' network makes it none. A connection from outside into a pod, masqueraded behind the
// device's address, keeps that source, as conntrack keeps its binding; a new one arrives from
// its own address. On BPF the device drains meanwhile.
func TestFormerUplinkPods(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReady(ctx, t, b, "masqOutBound: true\n")
		StartLineEcho(t, env.Pod, []netip.Addr{PodAddr6})
		dial := func(when, line string, want netip.Addr) (*Conn, netip.AddrPort) {
			t.Helper()
			conn, err := DialLine(ctx, env.Ext, netip.AddrPortFrom(public6, 0), PodAddr6)
			if err != nil {
				t.Fatalf("%s: from %s to the pod: %v", when, public6, err)
			}
			t.Cleanup(func() { conn.Close() })
			src, err := conn.Exchange(line)
			if err != nil || src.Addr() != want {
				t.Fatalf("%s: the pod saw %s (%v), want %s", when, src, err, want)
			}
			return conn, src
		}
		conn, src := dial("masqueraded toward the pods", "masqueraded", PodGW6)
		reconfigure(ctx, t, env, ag, "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\nmasqOutBound: true\n")
		for i := range 3 {
			if got, err := conn.Exchange(fmt.Sprintf("kept-%d", i)); err != nil || got != src {
				t.Fatalf("the open connection after the pods' network is kept: the pod saw %s (%v), before %s", got, err, src)
			}
		}
		dial("the pods' network kept", "kept", public6)
		if b.NAT {
			if err := ag.WaitLog(ctx, 1, "a former uplink drains", "pod0"); err != nil {
				t.Fatal(err)
			}
		}
	})
}
