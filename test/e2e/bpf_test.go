package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// The tests of this file are about the BPF datapath's own behaviour (the NAT it does without
// conntrack, and its lifecycle); the scenario table checks its policy like every backend's.

// bpfBackends is the BPF backend in each attach mode the kernel has.
func bpfBackends() []Backend {
	var out []Backend
	for _, mode := range BPFModes() {
		out = append(out, BPFBackend(mode))
	}
	return out
}

// keepPodsConfig keeps the pod network in IPv6 too, as in IPv4 the defaults keep 10.0.0.0/8:
// the pods' own device is then no uplink, and the node has one (see TestMasqueradedTowardPods
// for a policy that masquerades toward the pods).
var keepPodsConfig = "nonMasqueradeCIDRs: [10.0.0.0/8, " + PodNet6.String() + "]\n"

var (
	public4 = netip.MustParseAddr("8.8.8.8")
	public6 = netip.MustParseAddr("2001:4860:4860::8888")
)

// TestBPFSameSourcePort: two pods hold TCP connections from the same source port to the same
// destination; both work, and the destination sees the node's address with two distinct ports.
// --random-fully=false makes the pods ask for the same port.
func TestBPFSameSourcePort(t *testing.T) {
	eachBackend(t, bpfBackends(), []string{"--enable-ipv6", "--random-fully=false"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReadyNoFile(ctx, t, b)
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

// TestBPFInbound: a connection opened from outside (from a destination the policy masquerades)
// to a pod is answered from the pod's address; and a host connection keeps its source port,
// which a pod asking for the same port then does not get.
func TestBPFInbound(t *testing.T) {
	eachBackend(t, bpfBackends(), []string{"--enable-ipv6", "--random-fully=false"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReady(ctx, t, b, keepPodsConfig)
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

// TestBPFPingAndFragments: ping and ping -6 through the masquerade are answered, and so is a UDP
// datagram larger than the MTU (fragmented both ways). The external host has no route to the
// pods, so only a translated flow gets its answer.
func TestBPFPingAndFragments(t *testing.T) {
	eachBackend(t, bpfBackends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		testutil.RequirePrivileged(t, "ping")
		env.StartReadyNoFile(ctx, t, b)
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

// TestBPFRestart: a TCP connection held open through the masquerade keeps working, with the
// same address and port, while the agent is killed with SIGKILL, after it starts again (which
// reuses the pins and replaces the programs in place), after a SIGTERM; after `cleanup` nothing
// is left and traffic leaves with the pod's address.
func TestBPFRestart(t *testing.T) {
	eachBackend(t, bpfBackends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReady(ctx, t, b, keepPodsConfig)
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
		if err := ag.Kill(ctx); err != nil {
			t.Fatal(err)
		}
		check("agent killed")
		b.Verify(ctx, t, env)

		ag = env.StartAgent(ctx, t, b)
		if err := ag.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		check("agent restarted")
		if ag.Count("datapath loaded", "reusedRules=0") > 0 || ag.Count("pinned maps have other sizes") > 0 {
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
			for _, fam := range policy.Families() {
				if s := installed(ctx, t, env, m, fam); s != "" {
					t.Errorf("iptables-%s %s after cleanup:\n%s", m, fam, s)
				}
			}
		}
		env.RestoreReturnRoutes(ctx, t)
		env.Check(ctx, t, expect(Keep, "8.8.8.8", "2001:4860:4860::8888"), nil)
	})
}

// switchBackends runs the agent on one node (IPv6 on, no config file, every backend of bs
// required and prepared) on each backend of runs in turn, each over what the one before left:
// each must be ready, remove the others' state right after its first apply (left checks what
// the run's backend removed; run counts from 1), masquerade as the defaults ask, have installed
// what they ask and exit cleanly on SIGTERM.
func switchBackends(t *testing.T, bs, runs []Backend, left func(ctx context.Context, t *testing.T, env *Env, run int, b Backend)) {
	t.Helper()
	for _, b := range bs {
		requireBackend(t, b)
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewEnv(ctx, t, agentBin, []string{"--enable-ipv6"})
	for _, b := range bs {
		if b.Prepare != nil {
			b.Prepare(ctx, t, env)
		}
	}
	want := join(expect(Masq, "8.8.8.8", "2001:4860:4860::8888", "fd00::1"), expect(Keep, "10.1.2.3"))
	for i, b := range runs {
		ag := env.StartReadyNoFile(ctx, t, b)
		// The others go right after the first apply.
		if err := ag.WaitLog(ctx, 1, "no other backend's state is left"); err != nil {
			t.Fatal(err)
		}
		env.Check(ctx, t, want, nil)
		b.Verify(ctx, t, env)
		left(ctx, t, env, i+1, b)
		if err := ag.Stop(ctx); err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}
		if t.Failed() {
			t.Fatalf("run %d (%s) failed", i+1, b.Name)
		}
	}
}

// TestBackendSwitch: whichever backend the agent last started with is the only one installed.
func TestBackendSwitch(t *testing.T) {
	ipt := IptablesBackend(iptables.ModeNFT)
	bpfb := BestBPFBackend()
	auto := bpfb
	auto.Name, auto.Flags = "auto", []string{"--backend=auto"}
	switchBackends(t, []Backend{ipt, bpfb}, []Backend{ipt, bpfb, ipt, auto, bpfb}, func(ctx context.Context, t *testing.T, env *Env, run int, b Backend) {
		if b.Name == ipt.Name {
			if s := bpfLeft(t, env); s != "" {
				t.Errorf("run %d (%s): BPF state left: %s", run, b.Name, s)
			}
		}
	})
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// TestBPFMapResized: without --enable-ipv6 the IPv6 NAT table is small; a restart with
// --enable-ipv6 says that its size changed and replaces that map only (carrying its entries), so
// a held IPv4 flow keeps working (same address and port) and IPv6 is masqueraded from then on.
func TestBPFMapResized(t *testing.T) {
	b := BestBPFBackend()
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	requireBackend(t, b)
	env := NewBackendEnv(ctx, t, b, nil)
	env.StartReadyNoFile(ctx, t, b)
	StartLineEcho(t, env.Ext, []netip.Addr{public4})
	env.CutReturnRoutes(ctx, t)
	natV6 := func() uint32 {
		t.Helper()
		m, err := ebpf.LoadPinnedMap(filepath.Join(env.PinDir(), bpf.MapNATv6), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		return m.MaxEntries()
	}
	if n := natV6(); n >= 1<<16 {
		t.Errorf("without IPv6 the IPv6 NAT table has %d entries", n)
	}
	c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	before, err := c.Exchange("before")
	if err != nil {
		t.Fatal(err)
	}
	if err := env.Agent.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	env.Flags = []string{"--enable-ipv6"}
	ag := env.StartAgent(ctx, t, b)
	if err := ag.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ag.WaitLog(ctx, 1, "migration finished"); err != nil {
		t.Fatalf("the migration of the resized maps is not reported: %v\n%s", err, ag.Logs())
	}
	if ag.Count("pinned maps have other sizes", bpf.MapNATv6+": MaxEntries") != 1 || ag.Count(bpf.MapNATv4) != 0 {
		t.Errorf("the size change was not reported for nat_v6 alone:\n%s", ag.Logs())
	}
	if n := natV6(); n != 1<<18 {
		t.Errorf("with IPv6 the IPv6 NAT table has %d entries, want the default 262144", n)
	}
	if after, err := c.Exchange("after"); err != nil || after != before {
		t.Errorf("the IPv4 flow after the size change: %s (%v), before it %s", after, err, before)
	}
	env.Check(ctx, t, expect(Masq, "2001:4860:4860::8888", "8.8.8.8"), nil)
	b.Verify(ctx, t, env)
}

// TestBPFNATResizeKeepsFlows: restarts with another --nat-max-entries, smaller then larger,
// replace the NAT tables with tables of the new size and carry their flows over: a held TCP
// connection and UDP flow keep their source (address and port) and keep working, new
// connections are masqueraded, and no set-aside map is left pinned.
func TestBPFNATResizeKeepsFlows(t *testing.T) {
	for _, b := range bpfBackends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*ScenarioTimeout)
			defer cancel()
			requireBackend(t, b)
			env := NewBackendEnv(ctx, t, b, []string{"--nat-max-entries=4096"})
			env.StartReadyNoFile(ctx, t, b)
			StartLineEcho(t, env.Ext, []netip.Addr{public4})
			env.CutReturnRoutes(ctx, t) // every answer now proves a translation
			held := holdFlows(ctx, t, env, public4)
			for _, size := range []int{2048, 65536} {
				if err := env.Agent.Stop(ctx); err != nil {
					t.Fatal(err)
				}
				env.Flags = []string{"--nat-max-entries=" + strconv.Itoa(size)}
				ag := env.StartAgent(ctx, t, b)
				if err := ag.WaitReady(ctx); err != nil {
					t.Fatal(err)
				}
				// Ready comes with the apply that finished the migration; its log may still be on the way.
				if err := ag.WaitLog(ctx, 1, "migration finished"); err != nil {
					t.Fatalf("size %d: the migration of the resized maps is not reported: %v\n%s", size, err, ag.Logs())
				}
				if ag.Count("pinned maps have other sizes", bpf.MapNATv4+": MaxEntries") != 1 {
					t.Errorf("size %d: the resize is not reported:\n%s", size, ag.Logs())
				}
				held.check(t, "at "+strconv.Itoa(size)+" entries")
				m, err := ebpf.LoadPinnedMap(filepath.Join(env.PinDir(), bpf.MapNATv4), &ebpf.LoadPinOptions{ReadOnly: true})
				if err != nil {
					t.Fatal(err)
				}
				if n := m.MaxEntries(); n != uint32(size) {
					t.Errorf("nat_v4 has %d entries, want %d", n, size)
				}
				m.Close()
				if left, _ := filepath.Glob(env.PinDir() + "-resized-*"); len(left) > 0 {
					t.Errorf("set-aside maps left pinned: %v", left)
				}
				env.Check(ctx, t, expect(Masq, "8.8.8.8"), nil)
			}
		})
	}
}

// TestBPFFollowsUplinks: a new address of the uplink becomes the SNAT address and the flows of
// the old one are flushed; a device named by --interfaces that appears later gets the programs.
func TestBPFFollowsUplinks(t *testing.T) {
	eachBackend(t, bpfBackends(), []string{"--interfaces=" + Uplink + ",late0"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReadyNoFile(ctx, t, b)
		if env.Agent.Count("do not exist (yet)", "late0") == 0 {
			t.Errorf("the missing device is not reported:\n%s", env.Agent.Logs())
		}
		StartLineEcho(t, env.Ext, []netip.Addr{public4})
		env.CutReturnRoutes(ctx, t)
		c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if src, err := c.Exchange("old"); err != nil || src.Addr() != NodeAddr4 {
			t.Fatalf("before the change: %s %v", src, err)
		}

		// The address moves: the new one is promoted when the old one goes.
		newAddr := netip.MustParseAddr("10.99.0.7")
		if err := WriteSysctl(env.Node, "net.ipv4.conf."+Uplink+".promote_secondaries", "1"); err != nil {
			t.Fatal(err)
		}
		events := env.Agent.Count("datapath event")
		if err := testutil.IPBatch(ctx, env.Node, fmt.Sprintf("addr add %s/24 dev %s\naddr del %s/24 dev %s\n", newAddr, Uplink, NodeAddr4, Uplink)); err != nil {
			t.Fatal(err)
		}
		if err := env.Agent.WaitLog(ctx, events+1, "datapath event", "10.99.0.1 -> 10.99.0.7"); err != nil {
			t.Fatal(err)
		}
		if err := env.Agent.WaitLog(ctx, 1, "flows of the old address flushed"); err != nil {
			t.Fatal(err)
		}
		if src, err := env.Probe(ctx, "tcp", public4); err != nil || src.Addr() != newAddr {
			t.Errorf("a new flow after the change is seen from %s (%v), want %s", src, err, newAddr)
		}
		r, err := bpf.OpenPinnedReadOnly(env.PinDir())
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if err := r.NATEntries(policy.IPv4, func(e bpf.NATEntry) bool {
			if e.Dir == bpf.Egress && e.To.Addr() == NodeAddr4 || e.Dir == bpf.Ingress && e.Dst.Addr() == NodeAddr4 {
				t.Errorf("an entry of the old address is left: %+v", e)
			}
			return true
		}); err != nil {
			t.Fatal(err)
		}

		// The named device appears.
		if err := testutil.IPBatch(ctx, env.Node, fmt.Sprintf("link add late0 type veth peer name late1 netns %s\naddr add 192.0.2.10/24 dev late0\nlink set late0 up\n", env.Ext)); err != nil {
			t.Fatal(err)
		}
		if err := env.Agent.WaitLog(ctx, 1, "datapath event", "late0", "appeared"); err != nil {
			t.Fatal(err)
		}
		mode := strings.TrimPrefix(b.Name, "bpf-")
		want := ourPrograms(mode)
		if err := testutil.Poll(5*time.Second, 10*time.Millisecond, func() error {
			if got, _ := env.DevicePrograms(t, "late0"); !slices.Equal(got, want) {
				return testutil.NotYet("programs on late0: %v, want %v", got, want)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}

		// It goes away again: forgotten, its pins (tcx) removed, the uplink untouched.
		if err := testutil.IPBatch(ctx, env.Node, "link del late0\n"); err != nil {
			t.Fatal(err)
		}
		if err := env.Agent.WaitLog(ctx, 1, "a former uplink is left"); err != nil {
			t.Fatal(err)
		}
		var pins []string
		links, err := os.ReadDir(filepath.Join(env.PinRoot(), "links"))
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		for _, l := range links {
			pins = append(pins, l.Name())
		}
		var wantPins []string
		if mode == tc.ModeTCX {
			idx := env.UplinkIndex(t)
			wantPins = []string{fmt.Sprintf("%d-egress", idx), fmt.Sprintf("%d-ingress", idx)}
		}
		if !slices.Equal(pins, wantPins) {
			t.Errorf("link pins after late0 went: %v, want %v", pins, wantPins)
		}
		if got, _ := env.UplinkPrograms(t); !slices.Equal(got, want) {
			t.Errorf("programs on %s after late0 went: %v, want %v", Uplink, got, want)
		}
		if src, err := env.Probe(ctx, "udp", public4); err != nil || src.Addr() != newAddr {
			t.Errorf("after late0 went: seen from %s (%v), want %s", src, err, newAddr)
		}
	})
}

// TestAutoFallback: --backend auto uses iptables, and says why, when --bpffs is not a BPF
// filesystem; --backend bpf refuses to start there.
func TestAutoFallback(t *testing.T) {
	ipt := IptablesBackend(iptables.ModeNFT)
	requireBackend(t, ipt)
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewBackendEnv(ctx, t, ipt, nil)
	notBPF := t.TempDir()
	env.AgentFlags = []string{"--bpffs=" + notBPF}
	env.SetGood("", true)

	ag := env.StartAgent(ctx, t, Backend{Name: "bpf", Flags: []string{"--backend=bpf"}})
	if err := ag.WaitReady(ctx); err == nil {
		t.Fatal("--backend=bpf started without a BPF filesystem")
	}
	if ag.Count("is not a BPF filesystem") == 0 {
		t.Errorf("--backend=bpf did not say why it stopped:\n%s", ag.Logs())
	}

	auto := ipt
	auto.Flags = []string{"--backend=auto"}
	ag = env.StartAgent(ctx, t, auto)
	if err := ag.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if ag.Count("the BPF datapath cannot run here; using iptables", notBPF, "is not a BPF filesystem") != 1 {
		t.Errorf("auto did not log why it fell back:\n%s", ag.Logs())
	}
	env.Check(ctx, t, join(expect(Masq, "8.8.8.8"), expect(Keep, "10.1.2.3")), nil)
	ipt.Verify(ctx, t, env)
	m, err := ag.Scrape(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := m.Value("ip_masq_agent_datapath_info", Labels{"backend": "iptables", "attach_mode": "none"}); !ok || v != 1 {
		t.Errorf("datapath_info %v", m.Series("ip_masq_agent_datapath_info", nil))
	}
}
