package agent

import (
	"context"
	"errors"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// driftBackend is a fakeBackend with a drift check: tests damage it, and an apply repairs
// what drifted, except the kinds that are stuck.
type driftBackend struct {
	*fakeBackend
	dmu     sync.Mutex
	drifted []string
	stuck   []string
	checks  int
	fail    error
}

func newDriftBackend() *driftBackend { return &driftBackend{fakeBackend: newFakeBackend()} }

func (d *driftBackend) Apply(ctx context.Context, p *policy.Policy) error {
	if err := d.fakeBackend.Apply(ctx, p); err != nil {
		return err
	}
	d.set(func(d *driftBackend) {
		d.drifted = slices.DeleteFunc(d.drifted, func(k string) bool { return !slices.Contains(d.stuck, k) })
	})
	return nil
}

func (d *driftBackend) DriftKinds() []string {
	return []string{datapath.DriftProgram, datapath.DriftPin, datapath.DriftTrie}
}

func (d *driftBackend) CheckDrift(context.Context) ([]string, error) {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	d.checks++
	if d.fail != nil {
		return nil, d.fail
	}
	return slices.Clone(d.drifted), nil
}

func (d *driftBackend) set(f func(d *driftBackend)) {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	f(d)
}

func (d *driftBackend) checkCount() int {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	return d.checks
}

func drainApplies(b *fakeBackend) {
	for {
		select {
		case <-b.applied:
		default:
			return
		}
	}
}

// countLines counts the lines that contain every one of subs.
func countLines(logs string, subs ...string) int {
	n := 0
	for _, l := range strings.Split(logs, "\n") {
		if !slices.ContainsFunc(subs, func(s string) bool { return !strings.Contains(l, s) }) {
			n++
		}
	}
	return n
}

func withDrift(d time.Duration) func(*Options) { return func(o *Options) { o.DriftInterval = d } }

// TestDriftCheckHeals: no check before the first apply; damage found by a check is applied
// away, each kind counted and logged once; an intact datapath is not applied again.
func TestDriftCheckHeals(t *testing.T) {
	b := newDriftBackend()
	b.gate = make(chan struct{})
	r := startAgent(t, filepath.Join(t.TempDir(), "ip-masq-agent"), b, withDrift(10*time.Millisecond))
	time.Sleep(50 * time.Millisecond)
	if n := b.checkCount(); n != 0 {
		t.Fatalf("%d drift checks before the first apply", n)
	}
	close(b.gate)
	b.waitApply(t)
	r.waitReady(t)
	b.noApply(t, 100*time.Millisecond)
	if b.checkCount() == 0 {
		t.Fatal("no drift checks")
	}

	b.set(func(d *driftBackend) { d.drifted = []string{datapath.DriftTrie, datapath.DriftPin} })
	b.waitApply(t)
	r.waitStats(t, "two heals", func(s Stats) bool { return len(s.Heals) == 2 })
	b.set(func(d *driftBackend) { d.drifted = []string{datapath.DriftTrie} })
	st := r.waitStats(t, "a second trie heal", func(s Stats) bool { return s.Heals[datapath.DriftTrie] == 2 })
	if want := map[string]uint64{datapath.DriftTrie: 2, datapath.DriftPin: 1}; !maps.Equal(st.Heals, want) {
		t.Errorf("heals %v, want %v", st.Heals, want)
	}
	drainApplies(b.fakeBackend)
	b.noApply(t, 100*time.Millisecond)
	logs := r.log.String()
	for kind, n := range map[string]int{"trie": 2, "pin": 1} {
		if got := countLines(logs, "drift healed: restored", "what="+kind+" "); got != n {
			t.Errorf("%d heal lines for %s, want %d", got, kind, n)
		}
	}
	if !strings.Contains(logs, "trigger=drift") {
		t.Errorf("the repair is not logged as a drift apply")
	}
	// Stats hands out a copy.
	st.Heals[datapath.DriftTrie] = 99
	if r.agent.Stats().Heals[datapath.DriftTrie] != 2 {
		t.Error("Stats shares its map")
	}
}

// TestDriftPersists: damage an apply does not repair is applied again at every check, logged
// once while it persists and not counted; once repaired it counts as one heal.
func TestDriftPersists(t *testing.T) {
	b := newDriftBackend()
	r := startAgent(t, filepath.Join(t.TempDir(), "ip-masq-agent"), b, withDrift(10*time.Millisecond))
	b.waitApply(t)
	r.waitReady(t)
	b.set(func(d *driftBackend) {
		d.drifted, d.stuck = []string{datapath.DriftProgram}, []string{datapath.DriftProgram}
	})
	for range 3 {
		b.waitApply(t)
	}
	if h := r.agent.Stats().Heals; len(h) != 0 {
		t.Errorf("drift that persists was counted as healed: %v", h)
	}
	b.set(func(d *driftBackend) { d.stuck = nil })
	r.waitStats(t, "the heal", func(s Stats) bool { return s.Heals[datapath.DriftProgram] == 1 })
	drainApplies(b.fakeBackend)
	b.noApply(t, 100*time.Millisecond)
	logs := r.log.String()
	if n := strings.Count(logs, "drift persists after re-applying"); n != 1 {
		t.Errorf("%d lines about drift that persists, want 1", n)
	}
	if n := strings.Count(logs, "drift healed"); n != 1 {
		t.Errorf("%d heal lines, want 1", n)
	}
}

// TestDriftCheckFails: a check that fails changes nothing and is logged once until it works
// again.
func TestDriftCheckFails(t *testing.T) {
	b := newDriftBackend()
	r := startAgent(t, filepath.Join(t.TempDir(), "ip-masq-agent"), b, withDrift(5*time.Millisecond))
	b.waitApply(t)
	b.set(func(d *driftBackend) {
		d.fail, d.drifted = errors.New("iptables: resource busy"), []string{datapath.DriftChain}
	})
	from := b.checkCount()
	for b.checkCount() < from+5 {
		time.Sleep(5 * time.Millisecond)
	}
	if n := len(b.applied); n != 0 {
		t.Fatalf("%d applies while the check failed", n)
	}
	b.set(func(d *driftBackend) { d.fail = nil })
	r.waitStats(t, "the heal", func(s Stats) bool { return s.Heals[datapath.DriftChain] == 1 })
	logs := r.log.String()
	if n := strings.Count(logs, "drift check failed"); n != 1 || !strings.Contains(logs, "resource busy") {
		t.Errorf("%d lines about the failing check, want 1 with the error", n)
	}
	if n := strings.Count(logs, "drift check works again"); n != 1 {
		t.Errorf("%d lines about the check working again, want 1", n)
	}
}

// TestResyncCountsHeals: with the drift checks off, the resync repairs the damage, and the
// check before it counts the heal.
func TestResyncCountsHeals(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("resyncInterval: 100ms\n")
	b := newDriftBackend()
	r := startAgent(t, cm.path(), b, withDrift(-1))
	b.waitApply(t)
	time.Sleep(50 * time.Millisecond)
	if n := b.checkCount(); n > 1 {
		t.Fatalf("%d drift checks with the checks off and at most one resync", n)
	}
	b.set(func(d *driftBackend) { d.drifted = []string{datapath.DriftPin} })
	r.waitStats(t, "the heal", func(s Stats) bool { return s.Heals[datapath.DriftPin] == 1 })
	if !strings.Contains(r.log.String(), "trigger=resync") {
		t.Errorf("no resync apply logged")
	}
}
