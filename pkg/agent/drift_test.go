package agent

import (
	"errors"
	"maps"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
)

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
	b := &datapathtest.DriftBackend{}
	b.Gate = make(chan struct{})
	r := startAgent(t, filepath.Join(t.TempDir(), "ip-masq-agent"), b, withDrift(10*time.Millisecond))
	time.Sleep(50 * time.Millisecond)
	if n := b.Checks(); n != 0 {
		t.Fatalf("%d drift checks before the first apply", n)
	}
	close(b.Gate)
	b.WaitApply(t)
	r.waitReady(t)
	b.NoApply(t, 100*time.Millisecond)
	if b.Checks() == 0 {
		t.Fatal("no drift checks")
	}

	b.Damage(datapath.DriftTrie, datapath.DriftPin)
	b.WaitApply(t)
	r.waitStats(t, "two heals", func(s Stats) bool { return len(s.Heals) == 2 })
	b.Damage(datapath.DriftTrie)
	st := r.waitStats(t, "a second trie heal", func(s Stats) bool { return s.Heals[datapath.DriftTrie] == 2 })
	if want := map[string]uint64{datapath.DriftTrie: 2, datapath.DriftPin: 1}; !maps.Equal(st.Heals, want) {
		t.Errorf("heals %v, want %v", st.Heals, want)
	}
	b.Drain()
	b.NoApply(t, 100*time.Millisecond)
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
	b := &datapathtest.DriftBackend{}
	r := startAgent(t, filepath.Join(t.TempDir(), "ip-masq-agent"), b, withDrift(10*time.Millisecond))
	b.WaitApply(t)
	r.waitReady(t)
	// Stats is read without pause throughout: a kind must never show as healed and still
	// persisting at once (it did, between two locks, and failed CI).
	stop := make(chan struct{})
	torn := make(chan Stats, 1)
	go func() {
		defer close(torn)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if s := r.agent.Stats(); s.Heals[datapath.DriftProgram] > 0 && slices.Contains(s.Persisting, datapath.DriftProgram) {
				torn <- s
				return
			}
		}
	}()
	b.Stick(datapath.DriftProgram)
	b.Damage(datapath.DriftProgram)
	for range 3 {
		b.WaitApply(t)
	}
	if h := r.agent.Stats().Heals; len(h) != 0 {
		t.Errorf("drift that persists was counted as healed: %v", h)
	}
	if p := r.agent.Stats().Persisting; !slices.Equal(p, []string{datapath.DriftProgram}) {
		t.Errorf("persisting %q", p)
	}
	b.Stick()
	r.waitStats(t, "the heal", func(s Stats) bool { return s.Heals[datapath.DriftProgram] == 1 })
	if p := r.agent.Stats().Persisting; p != nil {
		t.Errorf("persisting %q after the heal", p)
	}
	close(stop)
	if s, ok := <-torn; ok {
		t.Errorf("stats showed %q healed %d times and still persisting", datapath.DriftProgram, s.Heals[datapath.DriftProgram])
	}
	b.Drain()
	b.NoApply(t, 100*time.Millisecond)
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
	b := &datapathtest.DriftBackend{}
	r := startAgent(t, filepath.Join(t.TempDir(), "ip-masq-agent"), b, withDrift(5*time.Millisecond))
	b.WaitApply(t)
	b.FailChecks(errors.New("iptables: resource busy"))
	b.Damage(datapath.DriftChain)
	from := b.Checks()
	if err := testutil.Poll(waitFor, 5*time.Millisecond, func() error {
		if n := b.Checks() - from; n < 5 {
			return testutil.NotYet("five failing checks, %d so far", n)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if n := len(b.Applied()); n != 0 {
		t.Fatalf("%d applies while the check failed", n)
	}
	b.FailChecks(nil)
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
	b := &datapathtest.DriftBackend{}
	r := startAgent(t, cm.path(), b, withDrift(-1))
	b.WaitApply(t)
	time.Sleep(50 * time.Millisecond)
	if n := b.Checks(); n > 1 {
		t.Fatalf("%d drift checks with the checks off and at most one resync", n)
	}
	b.Damage(datapath.DriftPin)
	r.waitStats(t, "the heal", func(s Stats) bool { return s.Heals[datapath.DriftPin] == 1 })
	if !strings.Contains(r.log.String(), "trigger=resync") {
		t.Errorf("no resync apply logged")
	}
}

// TestDriftUnenforced: a kind no apply repairs (datapath.DriftBypassed) applies nothing, makes
// /readyz fail naming it, is logged once when it starts and once when it ends, and is never
// counted as a heal; a repairable kind found beside it is still repaired.
func TestDriftUnenforced(t *testing.T) {
	b := &datapathtest.DriftBackend{}
	r := startAgent(t, filepath.Join(t.TempDir(), "ip-masq-agent"), b, withDrift(10*time.Millisecond))
	b.WaitApply(t)
	r.waitReady(t)
	b.Damage(datapath.DriftBypassed)
	r.waitStats(t, "the bypass", func(s Stats) bool { return slices.Equal(s.Unenforced, []string{datapath.DriftBypassed}) })
	b.NoApply(t, 100*time.Millisecond)
	if code, body := r.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "bypassed") {
		t.Errorf("readyz = %d %q, want 503 naming the bypass", code, body)
	}
	// Beside it, a repairable kind is repaired and healed; the bypass stays.
	b.Stick(datapath.DriftBypassed)
	b.Damage(datapath.DriftTrie, datapath.DriftBypassed)
	b.WaitApply(t)
	r.waitStats(t, "the trie heal", func(s Stats) bool { return s.Heals[datapath.DriftTrie] == 1 })
	if code, _ := r.ready(t); code != http.StatusServiceUnavailable {
		t.Errorf("readyz = %d while still bypassed", code)
	}
	b.Stick()
	b.Damage()
	r.waitStats(t, "the end of the bypass", func(s Stats) bool { return len(s.Unenforced) == 0 })
	r.waitReady(t)
	// The stats and readiness change a hair before the line about it is logged.
	r.waitLog(t, "enforced everywhere again")
	logs := r.log.String()
	if n := countLines(logs, "not enforced everywhere", "bypassed"); n != 1 {
		t.Errorf("%d lines about the bypass, want 1", n)
	}
	if n := countLines(logs, "enforced everywhere again"); n != 1 {
		t.Errorf("%d lines about its end, want 1", n)
	}
	if h := r.agent.Stats().Heals; h[datapath.DriftBypassed] != 0 || strings.Contains(logs, "what=bypassed") {
		t.Errorf("the bypass was counted or logged as a heal: %v", h)
	}
	if n := countLines(logs, "drift persists"); n != 0 {
		t.Errorf("%d drift persists lines for a kind no apply repairs", n)
	}
}
