package e2e

import (
	"context"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// probes is how many datagrams the neighbour tests send: each is one packet out of the uplink
// and one reply in.
const probes = 10

// sendProbes sends n datagrams to dst, each answered, and checks what the external host saw.
func sendProbes(ctx context.Context, t *testing.T, env *Env, dst netip.Addr, n int, want Want) {
	t.Helper()
	for i := range n {
		src, err := env.Datagram(ctx, dst, []byte("neighbour\n"))
		if err != nil {
			t.Fatalf("probe %d: %v", i, err)
		}
		if got := wantOf(src); got != want {
			t.Fatalf("probe %d: the external host saw %s, want the %s", i, src, want)
		}
	}
}

func wantOf(src netip.AddrPort) Want {
	if src.Addr() == NodeAddr4 || src.Addr() == NodeAddr6 {
		return Masq
	}
	return Keep
}

// TestNeighboursSeeEveryPacket: programs of other components behind ours (a tcx link appended
// after it on each hook, and a tc filter on each hook) and ahead of it that let the chain go on
// see every packet of masqueraded flows, and masquerading works throughout; nothing is reported
// as bypassed; cleanup leaves them all attached.
func TestNeighboursSeeEveryPacket(t *testing.T) {
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		ag := env.StartReady(ctx, t, b, "resyncInterval: 1h\n")
		dst := netip.MustParseAddr("8.8.8.8")
		sendProbes(ctx, t, env, dst, 1, Masq) // neighbours resolved, so each probe is one packet each way

		// Behind ours: in tcx mode any tc filter runs after the tcx programs; in tc mode a
		// filter of a higher priority than ours. Ahead of ours: a tcx link at the head of each
		// chain (in tc mode every tcx program runs first) and a filter of priority 1.
		placements := []Placement{
			{Dir: tc.Egress, TCX: true}, {Dir: tc.Ingress, TCX: true},
			{Dir: tc.Egress, Priority: 30000}, {Dir: tc.Ingress, Priority: 30000},
			{Dir: tc.Egress, TCX: true, Head: true}, {Dir: tc.Ingress, TCX: true, Head: true},
			{Dir: tc.Egress, Priority: 1}, {Dir: tc.Ingress, Priority: 1},
		}
		var ns []*Neighbour
		for i, at := range placements {
			ns = append(ns, env.AttachNeighbour(t, "nb"+string(rune('a'+i)), at, VerdictNext))
		}
		sendProbes(ctx, t, env, dst, probes, Masq)
		for i, n := range ns {
			if got := n.Count(t); got != probes {
				t.Errorf("neighbour at %s saw %d of the %d probe packets", placements[i], got, probes)
			}
		}

		if b.NAT {
			// Two drift checks with traffic in between: nothing bypassed, the neighbours
			// reported where they are.
			stop := env.Background(t, dst.String(), 20*time.Millisecond)
			time.Sleep(2500 * time.Millisecond)
			stop()
			m, err := ag.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, dir := range []string{"egress", "ingress"} {
				hook := Labels{"device": Uplink, "direction": dir}
				if v, ok := m.Value("ip_masq_agent_hook_bypassed", hook); !ok || v != 0 {
					t.Errorf("%s: hook_bypassed %v (present %v), want 0", dir, v, ok)
				}
				// tcx mode: only the tcx link at the head is ahead, every filter behind. tc
				// mode: every tcx link and the filter of priority 1 are ahead.
				want := map[string]float64{"ahead": 1, "behind": 3}
				if b.Info.AttachMode == tc.ModeTC {
					want = map[string]float64{"ahead": 3, "behind": 1}
				}
				for pos, want := range want {
					l := Labels{"device": Uplink, "direction": dir, "position": pos}
					if v, _ := m.Value("ip_masq_agent_hook_neighbours", l); v != want {
						t.Errorf("%s: hook_neighbours{position=%s} = %v, want %v", dir, pos, v, want)
					}
				}
			}
			if n := ag.Count("ends the chain"); n != 0 {
				t.Errorf("%d bypass warnings while every neighbour let the chain go on", n)
			}
		}
		if code, body, err := ag.Get(ctx, "/readyz"); err != nil || code != http.StatusOK {
			t.Errorf("readyz = %d %q %v", code, body, err)
		}

		if err := ag.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		if out, err := NSExec(ctx, env.Node, "", agentBin, env.DatapathArgs("cleanup", b)...); err != nil {
			t.Fatalf("cleanup: %v: %s", err, out)
		}
		b.Gone(ctx, t, env)
		for i, n := range ns {
			if !n.Attached(t, env) {
				t.Errorf("cleanup removed the neighbour at %s", placements[i])
			}
		}
	})
}

// TestNeighbourAheadEndsChain: a program ahead of ours that ends the chain takes the packets it
// passes past ours. On BPF that is reported within two drift intervals of the traffic it
// passes, by a warning, the hook metrics, /readyz, dump and the drift check; and the report ends
// when the program goes. On iptables, whose NAT runs in the IP stack, nothing changes.
func TestNeighbourAheadEndsChain(t *testing.T) {
	const interval = 500 * time.Millisecond
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.AgentFlags = append(env.AgentFlags, "--drift-check-interval="+interval.String())
		ag := env.StartReady(ctx, t, b, "resyncInterval: 1h\n")
		dst := netip.MustParseAddr("8.8.8.8")
		sendProbes(ctx, t, env, dst, 1, Masq)

		for _, dir := range []tc.Direction{tc.Egress, tc.Ingress} {
			at := Placement{Dir: dir, TCX: true, Head: true}
			if b.Info.AttachMode == tc.ModeTC {
				at = Placement{Dir: dir, Priority: 1}
			}
			t.Run(dir.String(), func(t *testing.T) {
				warned := ag.Count("ends the chain", "direction="+dir.String())
				n := env.AttachNeighbour(t, "ender_"+dir.String()[:2], at, VerdictPass)
				attached := time.Now()
				stop := env.Background(t, dst.String(), 20*time.Millisecond)
				defer stop()
				if !b.NAT {
					// iptables: masquerading is untouched, nothing to report.
					sendProbes(ctx, t, env, dst, 3, Masq)
					return
				}
				if err := ag.WaitLog(ctx, warned+1, "ends the chain", "direction="+dir.String()); err != nil {
					t.Fatal(err)
				}
				at, err := ag.LogTime(warned+1, "ends the chain", "direction="+dir.String())
				if err != nil {
					t.Fatal(err)
				}
				if took := at.Sub(attached); took > Scaled(3*interval+time.Second) {
					t.Errorf("bypass reported %v after the program came, want within about two drift intervals (%v)", took, interval)
				}
				if dir == tc.Egress {
					// The program ahead passes the pod's packets unmasqueraded.
					if got, src, err := env.Observe(ctx, "udp", dst); err != nil || got != Keep {
						t.Errorf("with the chain ended ahead of ours the external host saw %s (%v), want the pod's address", src, err)
					}
				}
				m, err := ag.Scrape(ctx)
				if err != nil {
					t.Fatal(err)
				}
				hook := Labels{"device": Uplink, "direction": dir.String()}
				if v, _ := m.Value("ip_masq_agent_hook_bypassed", hook); v != 1 {
					t.Errorf("hook_bypassed = %v, want 1", v)
				}
				if v, _ := m.Value("ip_masq_agent_hook_bypasses_total", hook); v != 1 {
					t.Errorf("hook_bypasses_total = %v, want 1", v)
				}
				if code, body, err := ag.Get(ctx, "/readyz"); err != nil || code != http.StatusServiceUnavailable || !strings.Contains(body, "bypassed") {
					t.Errorf("readyz = %d %q %v, want 503 naming the bypass", code, body, err)
				}
				if ag.Count("not enforced everywhere", "bypassed") == 0 {
					t.Errorf("the drift check did not report the bypass")
				}
				out, err := NSExec(ctx, env.Node, "", agentBin, env.DatapathArgs("dump", b)...)
				if err != nil {
					t.Fatalf("dump: %v: %s", err, out)
				}
				if !strings.Contains(string(out), "BYPASSED") || !strings.Contains(string(out), n.Name) {
					t.Errorf("dump does not show the bypass by %s:\n%s", n.Name, out)
				}
				t.Logf("dump:\n%s", out)

				// The program goes: ours sees packets again, the report ends.
				enforced := ag.Count("enforced everywhere again")
				n.Detach(t)
				if err := ag.WaitLog(ctx, enforced+1, "enforced everywhere again"); err != nil {
					t.Fatal(err)
				}
				if err := ag.WaitReady(ctx); err != nil {
					t.Fatal(err)
				}
				stop()
				sendProbes(ctx, t, env, dst, 3, Masq)
			})
		}
	})
}
