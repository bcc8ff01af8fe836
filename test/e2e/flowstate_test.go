package e2e

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// The NAT's flow-state promises (bpf/nat.h) with real traffic, on every backend: conntrack
// keeps each of them for the iptables backend, which is the reference.

// heldFlow is an idle masqueraded TCP connection and UDP flow from the pod to public4, with the
// sources the external host saw for them.
type heldFlow struct {
	tcp              *Conn
	udp              *UDPLine
	tcpSrc, udpSrc   netip.AddrPort
	tcpLine, udpLine int
}

// holdFlows opens them, two exchanges each: two-way flows, as an idle application's are.
func holdFlows(ctx context.Context, t *testing.T, env *Env, dst netip.Addr) *heldFlow {
	t.Helper()
	h := &heldFlow{}
	var err error
	if h.tcp, err = DialLine(ctx, env.Pod, netip.AddrPort{}, dst); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.tcp.Close() })
	if h.udp, err = DialUDPLine(ctx, env.Pod, dst); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.udp.Close() })
	h.tcpSrc, h.udpSrc = h.check(t, "opened")
	return h
}

// check exchanges on both flows and returns the sources seen, failing when either changed.
func (h *heldFlow) check(t *testing.T, when string) (tcpSrc, udpSrc netip.AddrPort) {
	t.Helper()
	for range 2 {
		h.tcpLine++
		src, err := h.tcp.Exchange("tcp-" + strconv.Itoa(h.tcpLine))
		if err != nil {
			t.Fatalf("%s: the held TCP connection: %v", when, err)
		}
		if h.tcpSrc.IsValid() && src != h.tcpSrc {
			t.Fatalf("%s: the held TCP connection is seen from %s, before from %s", when, src, h.tcpSrc)
		}
		tcpSrc = src
		h.udpLine++
		if src, err = h.udp.Exchange("udp-" + strconv.Itoa(h.udpLine)); err != nil {
			t.Fatalf("%s: the held UDP flow: %v", when, err)
		}
		if h.udpSrc.IsValid() && src != h.udpSrc {
			t.Fatalf("%s: the held UDP flow is seen from %s, before from %s", when, src, h.udpSrc)
		}
		udpSrc = src
	}
	return tcpSrc, udpSrc
}

// probeLoop opens a new TCP connection to dst every 50 ms until stop, counting those that work
// and those that fail (a SYN dropped twice is a failure: the dial gives up after 2 s).
func probeLoop(ctx context.Context, env *Env, dst netip.Addr) (stop func() (ok, failed int, first error)) {
	var okN, failN atomic.Int64
	var firstErr atomic.Value
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			case <-time.After(50 * time.Millisecond):
			}
			c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, dst)
			if err == nil {
				_, err = c.Exchange("probe")
				c.Close()
			}
			if err != nil {
				failN.Add(1)
				firstErr.CompareAndSwap(nil, err)
			} else {
				okN.Add(1)
			}
		}
	}()
	return func() (int, int, error) {
		close(done)
		wg.Wait()
		err, _ := firstErr.Load().(error)
		return int(okN.Load()), int(failN.Load()), err
	}
}

// floodSize is the number of SYNs, and of stray ACKs, of TestFloodsSpareIdleFlows.
const floodSize = 200_000

// TestFloodsSpareIdleFlows: an idle masqueraded TCP connection and an idle UDP flow survive
// 200,000 SYNs at a host port inside the NAT range (their SYN-ACKs are host flows) and 200,000
// stray ACKs at the pod's address, all from spoofed sources the external host owns; new
// connections keep working during and after, and the agent stays ready.
func TestFloodsSpareIdleFlows(t *testing.T) {
	const hostPort = 40404 // inside the default NAT range, so a pod mapping could collide
	for _, b := range backends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			requireBackend(t, b)
			ctx, cancel := context.WithTimeout(context.Background(), 3*ScenarioTimeout)
			defer cancel()
			env := NewBackendEnv(ctx, t, b, nil)
			// The held flows stay idle through the floods, which take seconds here and can take
			// minutes on a loaded machine: each backend's UDP idle timeout (conntrack's 30 s,
			// the BPF datapath's 2 min) is set beyond the test's deadline, so that what the
			// test sees is the floods' doing, never the timeout's.
			if b.NAT {
				env.AgentFlags = append(env.AgentFlags, "--nat-timeouts=udp=5m")
			}
			ag := env.StartReadyNoFile(ctx, t, b)
			if !b.NAT {
				for _, key := range []string{"nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"} {
					if err := WriteSysctl(env.Node, "net.netfilter."+key, "300"); err != nil {
						t.Fatal(err)
					}
				}
			}
			StartLineEcho(t, env.Ext, []netip.Addr{public4})
			env.CutReturnRoutes(ctx, t) // every answer now proves a translation
			env.OwnSpoofNet(ctx, t)
			var ln net.Listener
			if err := testutil.Do(env.Node, func() error {
				var err error
				ln, err = net.Listen("tcp", netip.AddrPortFrom(NodeAddr4, hostPort).String())
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer ln.Close()

			held := holdFlows(ctx, t, env, public4)
			forge := env.NewForger(t)
			stop := probeLoop(ctx, env, public4)
			start := time.Now()
			if err := forge.Flood(ctx, floodSize, func(i int) []byte {
				return forge.TCPFrame(SpoofSource(i), netip.AddrPortFrom(NodeAddr4, hostPort), "S", uint32(i), 0)
			}); err != nil {
				t.Fatal(err)
			}
			synTime := time.Since(start)
			if err := forge.Flood(ctx, floodSize, func(i int) []byte {
				return forge.TCPFrame(SpoofSource(i), netip.AddrPortFrom(PodAddr4, 8080), "A", uint32(i), uint32(i))
			}); err != nil {
				t.Fatal(err)
			}
			ok, failed, first := stop()
			t.Logf("%d SYNs at %s:%d in %v, %d stray ACKs at %s:8080 in %v; new connections meanwhile: %d worked, %d failed (%v)",
				floodSize, NodeAddr4, hostPort, synTime.Round(time.Millisecond), floodSize, PodAddr4,
				(time.Since(start) - synTime).Round(time.Millisecond), ok, failed, first)
			if failed > 0 || ok == 0 {
				t.Errorf("new connections during the floods: %d worked, %d failed (first: %v)", ok, failed, first)
			}
			held.check(t, "after the floods")
			if c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4); err != nil {
				t.Errorf("a new connection after the floods: %v", err)
			} else {
				if _, err := c.Exchange("after"); err != nil {
					t.Errorf("a new connection after the floods: %v", err)
				}
				c.Close()
			}
			if code, body, err := ag.Get(ctx, "/readyz"); err != nil || code != http.StatusOK {
				t.Errorf("/readyz after the floods: %d %q %v", code, body, err)
			}
			if b.NAT {
				m, err := ag.Scrape(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if v, _ := m.Value("ip_masq_agent_nat_established_evictions_total", Labels{}); v != 0 {
					t.Errorf("%v established flows left evictable", v)
				}
				t.Logf("NAT tables after the floods: %v", m.Series("ip_masq_agent_nat_fill_ratio", nil))
			}
		})
	}
}

// sniffFrom watches the external host's device while exchange runs and returns, of the last TCP
// segment from server to the node's address, its destination (a connection's NAT end) and the
// sequence number the server's next segment will carry.
func sniffFrom(t *testing.T, env *Env, server netip.AddrPort, exchange func()) (to netip.AddrPort, next uint32) {
	t.Helper()
	var fd int
	if err := testutil.Do(env.Ext, func() error {
		var err error
		// ETH_P_ALL: only such sockets see what the host sends.
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err == nil {
			tv := unix.NsecToTimeval((200 * time.Millisecond).Nanoseconds())
			err = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		}
		return err
	}); err != nil {
		t.Fatalf("sniffer: %v", err)
	}
	defer unix.Close(fd)
	exchange()
	buf := make([]byte, 65536)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if errors.Is(err, unix.EINTR) {
			continue // a receive timeout makes the call one a signal (Go's preemption) ends
		}
		if err != nil {
			if errors.Is(err, unix.EAGAIN) {
				break
			}
			t.Fatalf("sniffer: %v", err)
		}
		p := gopacket.NewPacket(buf[:n], layers.LayerTypeEthernet, gopacket.Default)
		ip, _ := p.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
		tcp, _ := p.Layer(layers.LayerTypeTCP).(*layers.TCP)
		if ip == nil || tcp == nil || !ip.SrcIP.Equal(server.Addr().AsSlice()) || uint16(tcp.SrcPort) != server.Port() ||
			!ip.DstIP.Equal(NodeAddr4.AsSlice()) {
			continue
		}
		to, next = netip.AddrPortFrom(NodeAddr4, uint16(tcp.DstPort)), tcp.Seq+uint32(len(tcp.Payload))
	}
	if !to.IsValid() {
		t.Fatalf("no segment from %s to the node seen", server)
	}
	return to, next
}

// TestBlindRSTKeepsMapping: with closing flows expiring after a second, RSTs from outside that
// the pod would not accept (half the sequence space away from what it expects, and within its
// window but not at the next byte) do not shorten the connection's life: well after, it still
// works from the same source.
func TestBlindRSTKeepsMapping(t *testing.T) {
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		b.FastExpiry(ctx, t, env)
		env.StartReadyNoFile(ctx, t, b)
		StartLineEcho(t, env.Ext, []netip.Addr{public4})
		env.CutReturnRoutes(ctx, t)
		c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		server := netip.AddrPortFrom(public4, LinePort)
		var src netip.AddrPort
		nat, seq := sniffFrom(t, env, server, func() {
			if src, err = c.Exchange("first"); err != nil {
				t.Fatal(err)
			}
		})
		if nat != src {
			t.Fatalf("sniffed segments to %s, the server saw %s", nat, src)
		}
		forge := env.NewForger(t)
		for _, s := range []uint32{seq + 1<<31, seq + 1000} {
			if err := forge.Send(forge.TCPFrame(server, nat, "R", s, 0)); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(3 * time.Second) // closing flows expire after 1 s, swept every 200 ms
		for i := range 3 {
			got, err := c.Exchange("after-" + strconv.Itoa(i))
			if err != nil {
				t.Fatalf("after out-of-window RSTs: %v", err)
			}
			if got != src {
				t.Fatalf("after out-of-window RSTs the connection is seen from %s, before from %s", got, src)
			}
		}
	})
}

// flipConfigs: 10.1.2.3 left alone (A), then masqueraded (B).
const (
	flipReturn = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqOutBound: true\n"
	flipMasq   = "masqueradeCIDRs: [10.1.2.3/32]\nnonMasqueradeCIDRs: [10.0.0.0/8]\nmasqOutBound: true\n"
)

// TestPolicyFlipKeepsFlows: TCP connections and UDP flows open across a policy change keep the
// source they started with, both ways of the flip; new ones follow the new policy.
func TestPolicyFlipKeepsFlows(t *testing.T) {
	dst := netip.MustParseAddr("10.1.2.3")
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReady(ctx, t, b, flipReturn)
		StartLineEcho(t, env.Ext, []netip.Addr{dst})
		open := func(want netip.Addr) *heldFlow {
			t.Helper()
			f := holdFlows(ctx, t, env, dst)
			if f.tcpSrc.Addr() != want || f.udpSrc.Addr() != want {
				t.Fatalf("new flows seen from %s (tcp) and %s (udp), want %s", f.tcpSrc, f.udpSrc, want)
			}
			return f
		}

		left := open(PodAddr4)
		reconfigure(ctx, t, env, ag, flipMasq)
		left.check(t, "after the flip to MASQUERADE")
		masqueraded := open(NodeAddr4)
		reconfigure(ctx, t, env, ag, flipReturn)
		left.check(t, "after the flip back")
		masqueraded.check(t, "after the flip back")
		open(PodAddr4)
	})
}

// TestPortRange1024: with a 1,024-port --to-ports, 973 concurrent connections toward one
// endpoint (95% of the range) all connect, and at most 1% of them ever found no port (a dropped
// SYN, counted; conntrack serves 972 of 973 in the same range).
func TestPortRange1024(t *testing.T) {
	const flows = 973
	eachBackend(t, backends(), []string{"--to-ports=50000-51023"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReadyNoFile(ctx, t, b)
		StartLineEcho(t, env.Ext, []netip.Addr{public4})
		env.CutReturnRoutes(ctx, t)
		refused := b.Refusals(ctx, t, env)
		conns := make([]*Conn, flows)
		errs := make([]error, flows)
		var wg sync.WaitGroup
		sem := make(chan struct{}, 64)
		for i := range flows {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				// A SYN that finds no port is dropped and sent again a second later: give it
				// three tries.
				for try := 0; try < 3; try++ {
					c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
					if err == nil {
						if _, err = c.Exchange("hello"); err == nil {
							conns[i] = c
							return
						}
						c.Close()
					}
					errs[i] = err
				}
			}()
		}
		wg.Wait()
		connected := 0
		ports := map[uint16]bool{}
		for i, c := range conns {
			if c == nil {
				t.Errorf("connection %d: %v", i, errs[i])
				continue
			}
			defer c.Close()
			connected++
			src, err := c.Exchange("again")
			if err != nil || src.Port() < 50000 || src.Port() > 51023 || ports[src.Port()] {
				t.Errorf("connection %d seen from %s (%v): want a port of its own in the range", i, src, err)
			}
			ports[src.Port()] = true
		}
		n := b.Refusals(ctx, t, env) - refused
		t.Logf("%d of %d concurrent connections toward one endpoint connected; %v SYNs found no port", connected, flows, n)
		if n > flows/100 {
			t.Errorf("%v of %d connections found no port at first, want at most 1%%", n, flows)
		}
	})
}

// TestEvictionOrder (BPF: --nat-max-entries is its table's size; conntrack's is the host's
// sysctl, which tests leave alone): with the smallest tables, a flood of 20,000 unreplied flows
// evicts none of the established ones, and none is left evictable.
func TestEvictionOrder(t *testing.T) {
	eachBackend(t, bpfBackends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.AgentFlags = append(env.AgentFlags, "--nat-max-entries=1024")
		ag := env.StartReadyNoFile(ctx, t, b)
		StartLineEcho(t, env.Ext, []netip.Addr{public4})
		env.CutReturnRoutes(ctx, t)
		var held []*heldFlow
		for range 50 { // 100 flows, 200 of the 1,024 confirmed entries
			held = append(held, holdFlows(ctx, t, env, public4))
		}
		// One datagram each to ports where nothing listens: flows that are never answered, 40
		// times as many as the unreplied table holds.
		newMasq := func() float64 {
			m, err := ag.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			v, _ := m.Value("ip_masq_agent_datapath_events_total", Labels{"event": "new_masq"})
			return v
		}
		before := newMasq()
		if err := UDPFlows(ctx, env.Pod, LoadTarget, 2, 20_000); err != nil {
			t.Fatal(err)
		}
		if n := newMasq() - before; n < 19_000 {
			t.Fatalf("the flood opened %v flows, want nearly 20,000", n)
		}
		for i, h := range held {
			h.check(t, "after the flood, held flow "+strconv.Itoa(i))
		}
		m, err := ag.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v, _ := m.Value("ip_masq_agent_nat_established_evictions_total", Labels{}); v != 0 {
			t.Errorf("%v established flows left evictable", v)
		}
		t.Logf("after the flood: %v", m.Series("ip_masq_agent_nat_entries", Labels{"family": "ipv4"}))
	})
}
