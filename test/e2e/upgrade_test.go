package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf/bpftest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// installOld installs on the node the datapath of an agent of layout `layout` (bpftest.Load:
// the fixture's object, its maps pinned where that agent pinned them, the default policy and
// the uplink's address written as it wrote them), or of a newer layout than any (newer), with
// its programs attached to the uplink as every agent attaches them: a pinned tcx link or a
// cls_bpf filter.
func installOld(ctx context.Context, t *testing.T, env *Env, mode string, layout int, newer bool) *bpftest.Old {
	t.Helper()
	opts := bpftest.Options{Uplink: env.UplinkIndex(t), SNAT4: NodeAddr4, NATEntries: 1 << 14}
	load := func() (*bpftest.Old, error) { return bpftest.Load(layout, env.PinRoot(), opts) }
	if newer {
		load = func() (*bpftest.Old, error) { return bpftest.Newer(env.PinRoot(), opts) }
	}
	old, err := load()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(old.Close)
	old.NeedPrograms(t)
	err = testutil.Do(env.Node, func() error {
		m, err := tc.NewManager(mode, bpfbackend.AttachOptions(env.BPFFS(), nil))
		if err != nil {
			return err
		}
		defer m.Close()
		return m.Attach(ctx, env.UplinkIndex(t), tc.Programs{Egress: old.Egress(), Ingress: old.Ingress()})
	})
	if err != nil {
		t.Fatalf("attach the programs of layout %d: %v", old.Layout, err)
	}
	return old
}

// programIDs are the ids of the programs on the uplink's hooks, egress then ingress.
func programIDs(t *testing.T, env *Env) []ebpf.ProgramID {
	t.Helper()
	var ids []ebpf.ProgramID
	err := testutil.Do(env.Node, func() error {
		for _, typ := range []ebpf.AttachType{ebpf.AttachTCXEgress, ebpf.AttachTCXIngress} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: env.UplinkIndex(t), Attach: typ})
			if err != nil {
				return err
			}
			for _, p := range res.Programs {
				ids = append(ids, p.ID)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func progID(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return id
}

// TestUpgradeFromLayout, from every shipped layout older than this build's and in both attach
// modes: the node runs that layout's datapath as its agent left it, with a TCP connection and
// a UDP flow open through it (the external host has no route back to the pod: only the old
// programs' masquerade gets answers). The current agent starts over it and migrates: every
// flow keeps its mapping (the same source port seen outside) and keeps working while the
// programs are swapped, a new connection every round is masqueraded, and afterwards the
// datapath is this layout's alone, the old pins gone.
func TestUpgradeFromLayout(t *testing.T) {
	for _, from := range bpftest.Layouts() {
		if from >= bpf.Layout {
			continue
		}
		for _, b := range bpfBackends() {
			t.Run(fmt.Sprintf("layout%d/%s", from, b.Name), func(t *testing.T) {
				t.Parallel()
				requireBackend(t, b)
				ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
				defer cancel()
				mode := strings.TrimPrefix(b.Name, "bpf-")
				env := NewBackendEnv(ctx, t, b, nil)
				env.SetGood("", true)
				old := installOld(ctx, t, env, mode, from, false)
				StartLineEcho(t, env.Ext, []netip.Addr{public4})
				env.CutReturnRoutes(ctx, t)
				conns, seen := heldFlows(ctx, t, env, public4)
				t.Logf("through layout %d's programs: TCP seen from %s, UDP from %s", from, seen[0], seen[1])
				w := watchFlows(ctx, env, conns, seen)
				time.Sleep(200 * time.Millisecond)

				ag := env.StartAgent(ctx, t, b)
				if err := ag.WaitReady(ctx); err != nil {
					t.Fatal(err)
				}
				if err := ag.WaitLog(ctx, 1, "migration finished"); err != nil {
					t.Fatal(err)
				}
				if ag.Count("migrating the pinned maps of an older layout", fmt.Sprintf("layout %d pinned under %s", from, env.PinRoot())) != 1 {
					t.Errorf("the agent did not say it migrates from layout %d:\n%s", from, ag.Logs())
				}
				time.Sleep(300 * time.Millisecond)
				w.stop(t, 10)
				b.Verify(ctx, t, env)

				if mode == tc.ModeTCX {
					ids := programIDs(t, env)
					if slices.Contains(ids, progID(t, old.Egress())) || slices.Contains(ids, progID(t, old.Ingress())) {
						t.Errorf("layout %d's programs still run on the uplink: %v", from, ids)
					}
				}
				names := pinNames(t, env.PinRoot())
				want := []string{filepath.Base(env.PinDir())}
				if mode == tc.ModeTCX {
					want = append([]string{bpfbackend.LinkDir}, want...)
				}
				if !slices.Equal(names, want) {
					t.Errorf("after the migration the pin root holds %v, want %v", names, want)
				}
			})
		}
	}
}

// A step of a migration an agent is killed at (TestUpgradeInterrupted).
type migrationStep int

const (
	// beforeSwap: the first pass and the catch-up are done; the old programs run.
	beforeSwap migrationStep = iota
	// afterSwap: this layout's programs replaced the old ones on the uplink.
	afterSwap
	// beforeFinish: as afterSwap, and the new programs carried traffic of their own (new flows)
	// before the agent finished.
	beforeFinish
)

func (s migrationStep) String() string {
	return [...]string{"before the swap", "after the swap", "before finish"}[s]
}

// killedAgent leaves on the node what an agent of this build migrating from the old layout
// leaves when it is killed at step: its maps opened over the pins (bpf.Open: the migration's
// first pass), the policy and the uplink written, the catch-up done, and from afterSwap on the
// migration marked swapped and its programs attached to the uplink, as Apply does them. Nothing
// finishes the migration.
func killedAgent(ctx context.Context, t *testing.T, env *Env, mode string, step migrationStep) {
	t.Helper()
	p := env.GoodPolicy(t)
	idx, mac := env.UplinkIndex(t), env.UplinkMAC(t)
	err := testutil.Do(env.Node, func() error {
		opened, err := bpf.Open(env.PinRoot(), bpf.OpenOptions{Policy: p})
		if err != nil {
			return err
		}
		defer opened.Close()
		if opened.Migration == nil {
			return fmt.Errorf("nothing to migrate under %s", env.PinRoot())
		}
		if err := opened.SyncPolicy(p); err != nil {
			return err
		}
		if _, err := opened.SetUplink(idx, bpf.Uplink{IPv4: NodeAddr4, MAC: mac}); err != nil {
			return err
		}
		if err := opened.Migration.CatchUp(opened.Datapath); err != nil || step == beforeSwap {
			return err
		}
		if err := opened.Migration.Swapping(); err != nil {
			return err
		}
		m, err := tc.NewManager(mode, bpfbackend.AttachOptions(env.BPFFS(), nil))
		if err != nil {
			return err
		}
		defer m.Close()
		return m.Attach(ctx, idx, tc.Programs{Egress: opened.Egress(), Ingress: opened.Ingress()})
	})
	if err != nil {
		t.Fatalf("the agent killed %s: %v", step, err)
	}
}

// TestUpgradeInterrupted, in both attach modes: an agent upgrading the node from the previous
// layout is killed at each step of the migration (before the swap, right after it, before it
// finished while the new programs carried flows of their own), with a TCP connection and a UDP
// flow open through the old programs (and, before finish, a second pair through the new ones;
// the external host has no route back to the pod). The next agent finishes the migration:
// every held flow keeps its source and works throughout, new connections are masqueraded, and
// the datapath ends as this layout's alone.
func TestUpgradeInterrupted(t *testing.T) {
	from := bpf.Layout - 1
	for _, step := range []migrationStep{beforeSwap, afterSwap, beforeFinish} {
		for _, b := range bpfBackends() {
			t.Run(fmt.Sprintf("%s/%s", strings.ReplaceAll(step.String(), " ", "-"), b.Name), func(t *testing.T) {
				t.Parallel()
				requireBackend(t, b)
				ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
				defer cancel()
				mode := strings.TrimPrefix(b.Name, "bpf-")
				env := NewBackendEnv(ctx, t, b, nil)
				env.SetGood("", true)
				installOld(ctx, t, env, mode, from, false)
				StartLineEcho(t, env.Ext, []netip.Addr{public4})
				env.CutReturnRoutes(ctx, t)
				conns, seen := heldFlows(ctx, t, env, public4)
				killedAgent(ctx, t, env, mode, step)
				if step == beforeFinish {
					more, moreSeen := heldFlows(ctx, t, env, public4)
					conns, seen = append(conns, more...), append(seen, moreSeen...)
				}
				w := watchFlows(ctx, env, conns, seen)
				time.Sleep(200 * time.Millisecond)
				events := pinnedEvents(t, env)

				ag := env.StartAgent(ctx, t, b)
				if err := ag.WaitReady(ctx); err != nil {
					t.Fatal(err)
				}
				if err := ag.WaitLog(ctx, 1, "migration finished"); err != nil {
					t.Fatal(err)
				}
				// Counters only grow (a counter that goes back breaks Prometheus' rate).
				for e, n := range pinnedEvents(t, env) {
					if n < events[e] {
						t.Errorf("after the migration event %s counts %d, before the agent %d", e, n, events[e])
					}
				}
				resumed := ag.Count("resuming a migration whose agent stopped after the swap") == 1
				if resumed != (step != beforeSwap) {
					t.Errorf("killed %s, the next agent resumed the migration: %v\n%s", step, resumed, ag.Logs())
				}
				time.Sleep(300 * time.Millisecond)
				w.stop(t, 10)
				b.Verify(ctx, t, env)
				want := []string{filepath.Base(env.PinDir())}
				if mode == tc.ModeTCX {
					want = append([]string{bpfbackend.LinkDir}, want...)
				}
				if names := pinNames(t, env.PinRoot()); !slices.Equal(names, want) {
					t.Errorf("after the migration the pin root holds %v, want %v", names, want)
				}
			})
		}
	}
}

// pinnedEvents reads the event counters of this layout's pinned maps.
func pinnedEvents(t *testing.T, env *Env) map[bpf.Event]uint64 {
	t.Helper()
	dp, err := bpf.OpenReadOnly(env.PinRoot())
	if err != nil || dp == nil {
		t.Fatalf("open the pinned maps: %v (%v)", err, dp)
	}
	defer dp.Close()
	n, err := dp.EventCounts()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// pinNames lists the names under dir.
func pinNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// TestRefuseNewerLayout: over the datapath of a newer agent (maps of a layout newer than this
// build's, their programs on the uplink, a connection open through them), as after a rollback,
// the agent refuses to start: it says why, stays unready, counts it in
// ip_masq_agent_datapath_refused, and leaves everything as it was: the pins, their maps and
// entries, the programs, the connection.
func TestRefuseNewerLayout(t *testing.T) {
	b := BestBPFBackend()
	requireBackend(t, b)
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewBackendEnv(ctx, t, b, nil)
	env.SetGood("", true)
	installOld(ctx, t, env, tc.ModeTCX, 0, true)
	StartLineEcho(t, env.Ext, []netip.Addr{public4})
	env.CutReturnRoutes(ctx, t)
	conns, seen := heldFlows(ctx, t, env, public4)
	before, progs := pinState(t, env.PinRoot()), programIDs(t, env)

	ag := env.StartAgent(ctx, t, b)
	want := fmt.Sprintf("holds layout %d, newer than this agent's %d", bpf.Layout+1, bpf.Layout)
	if err := ag.WaitLog(ctx, 1, "refusing the pinned maps", want); err != nil {
		t.Fatal(err)
	}
	// Retried (the first retry comes after half a second): still refused, still untouched.
	if err := ag.WaitLog(ctx, 2, "apply failed", "refused to take over the datapath installed on the node"); err != nil {
		t.Fatal(err)
	}
	code, body, err := ag.Get(ctx, "/readyz")
	if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(body, want) {
		t.Errorf("/readyz = %d %q %v, want 503 saying why", code, body, err)
	}
	m, err := ag.Scrape(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := m.Value("ip_masq_agent_datapath_refused", Labels{}); !ok || v != 1 {
		t.Errorf("ip_masq_agent_datapath_refused = %v (%v), want 1", v, ok)
	}
	if err := ag.Stop(ctx); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	if after := pinState(t, env.PinRoot()); !slices.Equal(before, after) {
		t.Errorf("the pins changed:\nbefore %v\nafter  %v", before, after)
	}
	if got := programIDs(t, env); !slices.Equal(got, progs) {
		t.Errorf("the uplink runs %v, before the agent %v", got, progs)
	}
	for i, c := range conns {
		if src, err := c.Exchange("after"); err != nil || src != seen[i] {
			t.Errorf("held flow %d after the refusal: %s (%v), before %s", i, src, err, seen[i])
		}
	}
}

// pinState is bpftest.PinState, failing the test on errors.
func pinState(t *testing.T, dir string) []string {
	t.Helper()
	st, err := bpftest.PinState(dir)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestReplaceNewerLayout: the way back from a rollback across layouts. Over the datapath of a
// newer agent (maps of a newer layout, their programs on the uplink, a connection open through
// them), an agent started with --replace-newer-layout takes it over instead of refusing it: it
// says so, its programs replace the newer ones in place (every new connection meanwhile is
// masqueraded), it becomes ready and manages the node (the datapath is its policy's), and only
// this layout's pins are left. The newer agent's flows are lost, as documented; none leaves with
// the pod's address.
func TestReplaceNewerLayout(t *testing.T) {
	for _, b := range bpfBackends() {
		t.Run(b.Name, func(t *testing.T) {
			requireBackend(t, b)
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
			defer cancel()
			mode := strings.TrimPrefix(b.Name, "bpf-")
			env := NewBackendEnv(ctx, t, b, nil)
			env.SetGood("", true)
			newer := installOld(ctx, t, env, mode, 0, true)
			StartLineEcho(t, env.Ext, []netip.Addr{public4})
			env.CutReturnRoutes(ctx, t)
			heldFlows(ctx, t, env, public4)
			w := watchFlows(ctx, env, nil, nil)

			b.Flags = append(slices.Clip(b.Flags), "--replace-newer-layout")
			ag := env.StartAgent(ctx, t, b)
			if err := ag.WaitReady(ctx); err != nil {
				t.Fatal(err)
			}
			if err := ag.WaitLog(ctx, 1, "migration finished"); err != nil {
				t.Fatal(err)
			}
			pins := filepath.Join(env.PinRoot(), fmt.Sprintf("v%d", bpf.Layout+1))
			if ag.Count("replacing the pinned maps of a newer layout", pins) != 1 || ag.Count("refusing") != 0 {
				t.Errorf("the agent did not say it replaces the newer layout's pins:\n%s", ag.Logs())
			}
			time.Sleep(300 * time.Millisecond)
			w.stop(t, 10)
			b.Verify(ctx, t, env)
			if mode == tc.ModeTCX {
				ids := programIDs(t, env)
				if slices.Contains(ids, progID(t, newer.Egress())) || slices.Contains(ids, progID(t, newer.Ingress())) {
					t.Errorf("the newer agent's programs still run on the uplink: %v", ids)
				}
			}
			want := []string{filepath.Base(env.PinDir())}
			if mode == tc.ModeTCX {
				want = append([]string{bpfbackend.LinkDir}, want...)
			}
			if names := pinNames(t, env.PinRoot()); !slices.Equal(names, want) {
				t.Errorf("after the takeover the pin root holds %v, want %v", names, want)
			}
			m, err := ag.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if v, ok := m.Value("ip_masq_agent_datapath_refused", Labels{}); !ok || v != 0 {
				t.Errorf("ip_masq_agent_datapath_refused = %v (%v), want 0", v, ok)
			}
		})
	}
}
