package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// A second uplink, uplink2, toward a second external host, which the node reaches only through
// a policy-routing rule (table 100), not by its default routes. Its own subnets are ones the
// test's policy keeps (10.0.0.0/8, fd00::/8): else they would make it an uplink by themselves.
var (
	uplink2Addr4 = netip.MustParseAddr("10.97.0.1")
	uplink2Addr6 = netip.MustParseAddr("fd97::1")
	ext2Addr4    = netip.MustParseAddr("10.97.0.2")
	ext2Addr6    = netip.MustParseAddr("fd97::2")
	// ext2's destinations: two the test's policy masquerades (the first external host has them
	// too, so the source it sees tells which device they left by), two it keeps.
	ext2Masq4, ext2Masq6 = netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("2001:db8::1")
	ext2Keep4, ext2Keep6 = netip.MustParseAddr("10.77.0.1"), netip.MustParseAddr("fd77::1")
)

// addSecondUplink builds uplink2 and the host behind it, with its echo servers and return routes
// to the pod network (so a pod address that leaks can be seen), and returns its namespace. The
// node's rule and routes toward it are the test's to add.
func (tp *Topology) addSecondUplink(ctx context.Context, t testing.TB) string {
	t.Helper()
	ns := testutil.NewNetns(t)
	if err := WriteSysctl(ns, "net.ipv6.conf.all.accept_dad", "0"); err != nil {
		t.Fatal(err)
	}
	if err := testutil.IPBatch(ctx, tp.Node, fmt.Sprintf(`link add uplink2 type veth peer name eth0 netns %s
addr add %s/24 dev uplink2
addr add %s/64 dev uplink2 nodad
link set uplink2 up
`, ns, uplink2Addr4, uplink2Addr6)); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	b.WriteString("link set lo up\n")
	for _, a := range []netip.Addr{ext2Masq4, ext2Keep4} {
		fmt.Fprintf(&b, "addr add %s/32 dev lo\n", a)
	}
	for _, a := range []netip.Addr{ext2Masq6, ext2Keep6} {
		fmt.Fprintf(&b, "addr add %s/128 dev lo nodad\n", a)
	}
	fmt.Fprintf(&b, `addr add %s/24 dev eth0
addr add %s/64 dev eth0 nodad
link set eth0 up
route add %s via %s dev eth0
route add %s via %s dev eth0
`, ext2Addr4, ext2Addr6, PodNet4, uplink2Addr4, PodNet6, uplink2Addr6)
	if err := testutil.IPBatch(ctx, ns, b.String()); err != nil {
		t.Fatal(err)
	}
	stop, err := StartEcho(ns, []netip.Addr{ext2Masq4, ext2Masq6, ext2Keep4, ext2Keep6}, EchoPort)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return ns
}

// routesToSecondUplink are the destinations table 100 sends out of uplink2, and their gateways.
var routesToSecondUplink = []struct {
	dst netip.Prefix
	gw  netip.Addr
}{
	{netip.MustParsePrefix("198.18.0.0/15"), ext2Addr4}, {netip.MustParsePrefix("10.77.0.0/16"), ext2Addr4},
	{netip.MustParsePrefix("2001:db8::/64"), ext2Addr6}, {netip.MustParsePrefix("fd77::/16"), ext2Addr6},
}

// policyRouting adds ("add") or deletes ("del") the node's routes of table 100, or its rules
// selecting table 100 for them.
func (e *Env) policyRouting(ctx context.Context, t testing.TB, op, what string) {
	t.Helper()
	var v4, v6 strings.Builder
	for _, r := range routesToSecondUplink {
		b := &v4
		if r.dst.Addr().Is6() {
			b = &v6
		}
		if what == "rules" {
			fmt.Fprintf(b, "rule %s to %s table 100\n", op, r.dst)
		} else {
			fmt.Fprintf(b, "route %s %s via %s dev uplink2 table 100\n", op, r.dst, r.gw)
		}
	}
	// IPv6 rules need -6, which a batch line cannot say.
	for _, batch := range []struct{ family, lines string }{{"-4", v4.String()}, {"-6", v6.String()}} {
		if err := testutil.IPBatch(ctx, e.Node, batch.lines, batch.family); err != nil {
			t.Fatalf("%s %s: %v", op, what, err)
		}
	}
}

// TestPolicyRoutedUplink: destinations that a policy-routing rule sends out of a second device
// (table 100, not the main table's default routes) are masqueraded there, behind that device's
// own address, and their replies come back, on every backend (iptables' MASQUERADE acts on
// whatever device a packet leaves by); destinations of the same table that the policy keeps
// keep the pod's address. The routes and then the rules come while the agent runs: a table no
// rule selects sends nothing out of uplink2, and on BPF the device becomes an uplink as the
// rules appear (dump and ip_masq_agent_uplink_info list it) and stops being one, its programs
// detached, as they go.
func TestPolicyRoutedUplink(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReady(ctx, t, b, "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n")
		env.addSecondUplink(ctx, t)
		type probe struct{ dst, want netip.Addr }
		// check probes until each destination is seen from want, over TCP and UDP: the agent
		// follows the routes, so the first probes may still leave as before (a fresh
		// 5-tuple each); within a few seconds every one must.
		check := func(when string, probes []probe) {
			t.Helper()
			within, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			for _, c := range probes {
				for _, proto := range []string{"tcp", "udp"} {
					if err := testutil.PollContext(within, 0, func() error {
						if got, err := env.Probe(ctx, proto, c.dst); err != nil || got.Addr() != c.want {
							return testutil.NotYet("the host saw %s (%v), want %s", got, err, c.want)
						}
						return nil
					}); err != nil {
						t.Errorf("%s: %s to %s: %v", when, proto, c.dst, err)
					}
				}
			}
		}

		// The routes alone: no rule selects table 100, so the default routes take the
		// masqueraded destinations to the first external host.
		env.policyRouting(ctx, t, "add", "routes")
		check("table 100 without rules", []probe{{ext2Masq4, NodeAddr4}, {ext2Masq6, NodeAddr6}})
		if b.NAT {
			// No event says the agent has seen the routes, so what it did with them is read
			// after the probes above gave it seconds to: its log keeps any attachment it made.
			if progs, _ := env.DevicePrograms(t, "uplink2"); len(progs) != 0 {
				t.Errorf("uplink2 has programs while no rule selects its table: %v", progs)
			}
			if n := env.Agent.Count("programs attached", "uplink2"); n != 0 {
				t.Errorf("the agent attached to uplink2 %d times while no rule selected its table:\n%s", n, env.Agent.Logs())
			}
		}

		// The rules: table 100 sends the destinations out of uplink2.
		env.policyRouting(ctx, t, "add", "rules")
		check("table 100 selected", []probe{{ext2Masq4, uplink2Addr4}, {ext2Masq6, uplink2Addr6}, {ext2Keep4, PodAddr4}, {ext2Keep6, PodAddr6}})
		if b.NAT && env.Agent.Count("programs attached", "uplink2") == 0 {
			// What the check before the rules reads: the line that names uplink2 when it is one.
			t.Errorf("no \"programs attached\" line names uplink2 once its table is selected:\n%s", env.Agent.Logs())
		}
		// The main uplink still masquerades.
		env.Check(ctx, t, expect(Masq, "8.8.8.8", "2001:4860:4860::8888"), nil)
		// A masquerade address must be one of the device its destinations leave by:
		// uplink2's is not the default routes', the main uplink's not table 100's.
		good := env.Good
		for _, c := range []struct{ config, log string }{
			{"masqueradeAddress: " + uplink2Addr4.String() + "\n",
				"masqueradeAddress 10.97.0.1 is not an address of uplink, which 0.0.0.0/0 leaves by"},
			{"masqueradeCIDRs: [{cidr: 198.18.0.0/15, address: " + NodeAddr4.String() + "}]\n",
				"masqueradeCIDRs[0] 10.99.0.1 is not an address of uplink2, which 198.18.0.0/15 leaves by"},
		} {
			rejected := ag.Count("config rejected", c.log)
			if err := env.Config.Write(good + c.config); err != nil {
				t.Fatal(err)
			}
			if err := ag.WaitLog(ctx, rejected+1, "config rejected", c.log); err != nil {
				t.Fatal(err)
			}
		}
		if err := env.Config.Write(good); err != nil {
			t.Fatal(err)
		}
		check("the rejected configurations", []probe{{ext2Masq4, uplink2Addr4}})
		if b.NAT {
			out, err := NSExec(ctx, env.Node, "", agentBin, append(env.DatapathArgs("dump", b), "--config="+env.Config.Path())...)
			if err != nil {
				t.Fatalf("dump: %v: %s", err, out)
			}
			for _, want := range []string{"route 198.18.0.0/15 table 100, route 2001:db8::/64 table 100  yes", "default route"} {
				if !strings.Contains(string(out), want) {
					t.Errorf("dump does not list %q:\n%s", want, out)
				}
			}
			m, err := ag.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for dev, via := range map[string]string{Uplink: "default route", "uplink2": "route 198.18.0.0/15 table 100, route 2001:db8::/64 table 100"} {
				if v, ok := m.Value("ip_masq_agent_uplink_info", Labels{"device": dev, "via": via, "covered": "true"}); !ok || v != 1 {
					t.Errorf("uplink_info of %s via %q: %v %v, want 1; series %v", dev, via, v, ok, m.Series("ip_masq_agent_uplink_info", nil))
				}
			}
			if progs, _ := env.DevicePrograms(t, "uplink2"); !slices.Equal(progs, ourPrograms(strings.TrimPrefix(b.Name, "bpf-"))) {
				t.Errorf("uplink2 runs %v, want our egress and ingress programs", progs)
			}
		}

		// The rules removed: the default routes take the traffic back, and uplink2 is no
		// uplink any more.
		env.policyRouting(ctx, t, "del", "rules")
		check("the rules removed", []probe{{ext2Masq4, NodeAddr4}, {ext2Masq6, NodeAddr6}})
		if b.NAT {
			if err := env.Agent.WaitLog(ctx, 1, "a former uplink is left: programs detached"); err != nil {
				t.Fatal(err)
			}
			if progs, _ := env.DevicePrograms(t, "uplink2"); len(progs) != 0 {
				t.Errorf("uplink2 still runs %v once no route of pod traffic leaves by it", progs)
			}
		}
	})
}

// TestMasqueradedTowardPods: where the policy masquerades toward the pods themselves (IPv6
// without nonMasqueradeCIDRs of its family; the defaults keep 10.0.0.0/8 in IPv4), the pods'
// device is one pod traffic leaves by, and a connection from outside into a pod is masqueraded
// behind the device's address on every backend, as iptables' MASQUERADE does in POSTROUTING;
// the pods' own flows keep working, their replies untouched. On BPF the device is an uplink by
// its route.
func TestMasqueradedTowardPods(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReady(ctx, t, b, "masqOutBound: true\n")
		StartLineEcho(t, env.Pod, []netip.Addr{PodAddr4, PodAddr6})
		for _, c := range []struct{ from, pod, want netip.Addr }{{public4, PodAddr4, public4}, {public6, PodAddr6, PodGW6}} {
			conn, err := DialLine(ctx, env.Ext, netip.AddrPortFrom(c.from, 0), c.pod)
			if err != nil {
				t.Fatalf("from %s to the pod: %v", c.from, err)
			}
			src, err := conn.Exchange("inbound")
			conn.Close()
			if err != nil || src.Addr() != c.want {
				t.Errorf("from %s, the pod saw %s (%v), want %s", c.from, src, err, c.want)
			}
		}
		env.Check(ctx, t, expect(Masq, "8.8.8.8", "2001:4860:4860::8888", "2001:db8::1"), nil)
		if !b.NAT {
			return
		}
		out, err := NSExec(ctx, env.Node, "", agentBin, append(env.DatapathArgs("dump", b), "--config="+env.Config.Path())...)
		if err != nil {
			t.Fatalf("dump: %v: %s", err, out)
		}
		if !strings.Contains(string(out), "\npod0 ") || !strings.Contains(string(out), "route fd00:10:244:1::/64  yes") {
			t.Errorf("dump does not list pod0 by its route to the pods:\n%s", out)
		}
	})
}
