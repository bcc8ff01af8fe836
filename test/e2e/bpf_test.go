package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// The tests of this file are about the BPF datapath's own behaviour (the NAT it does without
// conntrack, and its lifecycle); the scenario table checks its policy like every backend's.

func bpfBackends() []Backend { return []Backend{BPFBackend(tc.ModeTCX), BPFBackend(tc.ModeTC)} }

// bpfEnv builds a topology, starts the agent on backend b with flags and waits until it is ready.
func bpfEnv(ctx context.Context, t *testing.T, b Backend, flags ...string) *Env {
	t.Helper()
	requireBackend(t, b)
	env := NewEnv(ctx, t, agentBin, flags)
	b.Prepare(ctx, t, env)
	env.SetGood("", true)
	if err := env.StartAgent(ctx, t, b).WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	return env
}

var (
	public4 = netip.MustParseAddr("8.8.8.8")
	public6 = netip.MustParseAddr("2001:4860:4860::8888")
)

// TestBPFSameSourcePort: two pods hold TCP connections from the same source port to the same
// destination; both work, and the destination sees the node's address with two distinct ports.
// --random-fully=false makes the pods ask for the same port.
func TestBPFSameSourcePort(t *testing.T) {
	for _, b := range bpfBackends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
			defer cancel()
			env := bpfEnv(ctx, t, b, "--enable-ipv6", "--random-fully=false")
			StartLineEcho(t, env.Ext, []netip.Addr{public4, public6})
			env.CutReturnRoutes(ctx, t)
			pod2, pod2v4, pod2v6 := env.AddPod(ctx, t, 2)
			for _, c := range []struct {
				dst            netip.Addr
				local1, local2 netip.Addr
			}{{public4, PodAddr4, pod2v4}, {public6, PodAddr6, pod2v6}} {
				const port = 40000
				a, err := DialLine(ctx, env.Pod, netip.AddrPortFrom(c.local1, port), c.dst)
				if err != nil {
					t.Fatal(err)
				}
				defer a.Close()
				bc, err := DialLine(ctx, pod2, netip.AddrPortFrom(c.local2, port), c.dst)
				if err != nil {
					t.Fatal(err)
				}
				defer bc.Close()
				var seen [2]netip.AddrPort
				for round := range 3 {
					for i, conn := range []*Conn{a, bc} {
						src, err := conn.Exchange(fmt.Sprintf("pod%d-round%d", i+1, round))
						if err != nil {
							t.Fatalf("pod %d, round %d: %v", i+1, round, err)
						}
						if round > 0 && src != seen[i] {
							t.Fatalf("pod %d: the source moved from %s to %s", i+1, seen[i], src)
						}
						seen[i] = src
					}
				}
				node := NodeAddr4
				if c.dst.Is6() {
					node = NodeAddr6
				}
				if seen[0].Addr() != node || seen[1].Addr() != node || seen[0].Port() == seen[1].Port() {
					t.Errorf("%s saw %s and %s: want the node address %s with distinct ports", c.dst, seen[0], seen[1], node)
				}
				t.Logf("%s saw the pods' port %d as %s and %s", c.dst, port, seen[0], seen[1])
			}
		})
	}
}

// TestBPFInbound: a connection opened from outside (from a destination the policy masquerades)
// to a pod is answered from the pod's address; and a host connection keeps its source port,
// which a pod asking for the same port then does not get.
func TestBPFInbound(t *testing.T) {
	for _, b := range bpfBackends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
			defer cancel()
			env := bpfEnv(ctx, t, b, "--enable-ipv6", "--random-fully=false")
			StartLineEcho(t, env.Pod, []netip.Addr{PodAddr4, PodAddr6})
			StartLineEcho(t, env.Ext, []netip.Addr{public4, public6})
			for _, c := range []struct{ from, pod netip.Addr }{{public4, PodAddr4}, {public6, PodAddr6}} {
				conn, err := DialLine(ctx, env.Ext, netip.AddrPortFrom(c.from, 0), c.pod)
				if err != nil {
					t.Fatalf("from %s to the pod: %v", c.from, err)
				}
				defer conn.Close()
				src, err := conn.Exchange("inbound")
				if err != nil {
					t.Fatal(err)
				}
				if src != conn.Local() {
					t.Errorf("the pod saw %s, want the client %s", src, conn.Local())
				}
				if got := conn.c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap(); got != c.pod {
					t.Errorf("answered from %s, want the pod address %s", got, c.pod)
				}
			}

			// The host's own connection keeps its port; a pod that wants the same one gets another.
			env.CutReturnRoutes(ctx, t)
			for _, c := range []struct{ node, pod, dst netip.Addr }{{NodeAddr4, PodAddr4, public4}, {NodeAddr6, PodAddr6, public6}} {
				const port = 45678
				host, err := DialLine(ctx, env.Node, netip.AddrPortFrom(c.node, port), c.dst)
				if err != nil {
					t.Fatal(err)
				}
				defer host.Close()
				if src, err := host.Exchange("host"); err != nil || src != netip.AddrPortFrom(c.node, port) {
					t.Fatalf("host connection seen as %s (%v), want %s:%d", src, err, c.node, port)
				}
				pod, err := DialLine(ctx, env.Pod, netip.AddrPortFrom(c.pod, port), c.dst)
				if err != nil {
					t.Fatal(err)
				}
				defer pod.Close()
				src, err := pod.Exchange("pod")
				if err != nil {
					t.Fatal(err)
				}
				if src.Addr() != c.node || src.Port() == port {
					t.Errorf("pod connection from port %d seen as %s: want the node address and another port", port, src)
				}
				if src, err := host.Exchange("host-again"); err != nil || src.Port() != port {
					t.Errorf("host connection after the pod's: %s %v", src, err)
				}
			}
		})
	}
}

// TestBPFPingAndFragments: ping and ping -6 through the masquerade are answered, and so is a UDP
// datagram larger than the MTU (fragmented both ways). The external host has no route to the
// pods, so only a translated flow gets its answer.
func TestBPFPingAndFragments(t *testing.T) {
	for _, b := range bpfBackends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			testutil.RequirePrivileged(t, "ping")
			ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
			defer cancel()
			env := bpfEnv(ctx, t, b, "--enable-ipv6")
			StartLineEcho(t, env.Ext, []netip.Addr{public4, public6})
			env.CutReturnRoutes(ctx, t)
			for _, dst := range []netip.Addr{public4, public6} {
				args := []string{"-c", "3", "-i", "0.2", "-W", "2", dst.String()}
				if dst.Is6() {
					args = append([]string{"-6"}, args...)
				}
				out, err := NSExec(ctx, env.Pod, "", "ping", args...)
				if err != nil {
					t.Errorf("ping %s through the masquerade: %v\n%s", dst, err, out)
				} else {
					t.Logf("ping %s: %s", dst, lastLine(string(out)))
				}
				src, err := BigDatagram(ctx, env.Pod, dst, 4000)
				if err != nil {
					t.Error(err)
					continue
				}
				if node := NodeAddr(policy.FamilyOf(dst)); src.Addr() != node {
					t.Errorf("the 4000-byte datagram to %s was seen from %s, want %s", dst, src, node)
				}
			}
		})
	}
}

// TestBPFRestart: a TCP connection held open through the masquerade keeps working, with the
// same address and port, while the agent is killed with SIGKILL, after it starts again (which
// reuses the pins and replaces the programs in place), after a SIGTERM; after `cleanup` nothing
// is left and traffic leaves with the pod's address.
func TestBPFRestart(t *testing.T) {
	for _, b := range bpfBackends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
			defer cancel()
			env := bpfEnv(ctx, t, b, "--enable-ipv6")
			StartLineEcho(t, env.Ext, []netip.Addr{public4, public6})
			env.CutReturnRoutes(ctx, t)
			var conns []*Conn
			var seen []netip.AddrPort
			for _, dst := range []netip.Addr{public4, public6} {
				c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, dst)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				src, err := c.Exchange("start")
				if err != nil {
					t.Fatal(err)
				}
				if src.Addr() != NodeAddr(policy.FamilyOf(dst)) {
					t.Fatalf("%s saw %s, want the node address", dst, src)
				}
				conns, seen = append(conns, c), append(seen, src)
			}
			check := func(when string) {
				t.Helper()
				for i, c := range conns {
					src, err := c.Exchange(strings.ReplaceAll(when, " ", "-"))
					if err != nil {
						t.Fatalf("%s: %v", when, err)
					}
					if src != seen[i] {
						t.Fatalf("%s: the server sees %s, before it saw %s", when, src, seen[i])
					}
				}
			}

			ag := env.Agent
			if err := ag.cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			<-ag.done
			check("agent killed")
			b.Verify(ctx, t, env)

			ag = env.StartAgent(ctx, t, b)
			if err := ag.WaitReady(ctx); err != nil {
				t.Fatal(err)
			}
			check("agent restarted")
			if ag.Count("datapath loaded", "reusedRules=0") > 0 || ag.Count("pinned maps have another layout") > 0 {
				t.Errorf("the restart did not reuse the pinned maps:\n%s", ag.Logs())
			}
			if ag.Count("program replaced in place") != 2 || ag.Count(`msg=attached`) != 0 {
				t.Errorf("the restart did not replace both programs in place:\n%s", ag.Logs())
			}

			if err := ag.Stop(ctx); err != nil {
				t.Fatalf("agent exit after SIGTERM: %v", err)
			}
			check("agent stopped")
			env.Check(ctx, t, expect(Masq, "8.8.8.8", "2001:4860:4860::8888"), nil)

			args := append(append([]string{"cleanup"}, b.Flags...), env.AgentFlags...)
			out, err := NSExec(ctx, env.Node, "", agentBin, args...)
			if err != nil {
				t.Fatalf("cleanup: %v", err)
			}
			t.Logf("cleanup: %s", strings.TrimSpace(string(out)))
			if s := bpfLeft(t, env); s != "" {
				t.Errorf("left after cleanup: %s", s)
			}
			for _, m := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
				for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
					if s := installed(ctx, t, env, m, fam); s != "" {
						t.Errorf("iptables-%s %s after cleanup:\n%s", m, fam, s)
					}
				}
			}
			env.RestoreReturnRoutes(ctx, t)
			env.Check(ctx, t, expect(Keep, "8.8.8.8", "2001:4860:4860::8888"), nil)
		})
	}
}

// TestBackendSwitch: whichever backend the agent last started with is the only one installed.
func TestBackendSwitch(t *testing.T) {
	ipt := IptablesBackend(iptables.ModeNFT)
	bpfb := BPFBackend(tc.ModeTCX)
	auto := bpfb
	auto.Name, auto.Flags = "auto", []string{"--backend=auto"}
	requireBackend(t, ipt)
	requireBackend(t, bpfb)
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewEnv(ctx, t, agentBin, []string{"--enable-ipv6"})
	ipt.Prepare(ctx, t, env)
	bpfb.Prepare(ctx, t, env)
	env.SetGood("", true)
	want := join(expect(Masq, "8.8.8.8", "2001:4860:4860::8888", "fd00::1"), expect(Keep, "10.1.2.3"))
	for i, b := range []Backend{ipt, bpfb, ipt, auto, bpfb} {
		ag := env.StartAgent(ctx, t, b)
		if err := ag.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		// The other backend goes right after the first apply.
		if err := ag.WaitLog(ctx, 1, "backends are exclusive"); err != nil {
			t.Fatal(err)
		}
		env.Check(ctx, t, want, nil)
		b.Verify(ctx, t, env)
		if b.Name == ipt.Name {
			if s := bpfLeft(t, env); s != "" {
				t.Errorf("run %d (%s): BPF state left: %s", i+1, b.Name, s)
			}
		}
		if err := ag.Stop(ctx); err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}
		if t.Failed() {
			t.Fatalf("run %d (%s) failed", i+1, b.Name)
		}
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
