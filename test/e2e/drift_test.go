package e2e

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// HealLimit is how soon after a damage the datapath must be whole again (issue 9: within 2 s;
// times TimeoutScaleEnv under emulation).
// The agent checks every second (--drift-check-interval), so a heal takes a second at most plus
// the apply; the rest is slack for a loaded machine.
var HealLimit = Scaled(2 * time.Second)

// heals reads ip_masq_agent_heals_total by what.
func heals(ctx context.Context, t *testing.T, ag *Agent) map[string]float64 {
	t.Helper()
	var m Metrics
	var err error
	for range 3 { // a scrape may time out on a busy machine
		if m, err = ag.Scrape(ctx); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, s := range m["ip_masq_agent_heals_total"].GetMetric() {
		out[labelsOf(s)["what"]] = value(s)
	}
	return out
}

var healTookRE = regexp.MustCompile(`what=(\S+) took=(\S+)`)

// TestDriftHealed: each damage of the backend's list, done behind the running agent's back, is
// repaired within HealLimit by the drift check (not the resync: the file asks for one an hour),
// counted exactly once under its kinds in ip_masq_agent_heals_total and logged exactly once per
// kind; nothing else is counted; afterwards the datapath is exactly what the policy asks and
// traffic is masqueraded as before.
func TestDriftHealed(t *testing.T) {
	const cfg = "resyncInterval: 1h\n"
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		if len(b.Damages) == 0 || slices.ContainsFunc(b.Damages, func(d Damage) bool { return len(d.What) == 0 }) {
			t.Fatalf("backend %s: no damages, or a damage without kinds", b.Name)
		}
		ag := env.StartReady(ctx, t, b, cfg)
		want := join(expect(Masq, "8.8.8.8"), expect(Keep, "10.1.2.3"))
		env.Check(ctx, t, want, nil)
		counted := heals(ctx, t, ag)
		for _, k := range b.DriftWhat {
			if v, ok := counted[k]; !ok || v != 0 {
				t.Fatalf("heals_total{what=%q} = %v (present %v) before any damage, want a 0 series", k, v, ok)
			}
		}
		for _, d := range b.Damages {
			logged := map[string]int{}
			for _, k := range d.What {
				logged[k] = ag.Count("drift healed", "what="+k+" ")
			}
			d.Do(ctx, t, env)
			damaged := time.Now()
			// The agent's log says when each kind was repaired (the test's own polls of the
			// datapath would add their cost to the measure).
			var took time.Duration
			for _, k := range d.What {
				counted[k]++
				if err := ag.WaitLog(ctx, logged[k]+1, "drift healed", "what="+k+" "); err != nil {
					t.Fatalf("%s: %v", d.Name, err)
				}
				at, err := ag.LogTime(logged[k]+1, "drift healed", "what="+k+" ")
				if err != nil {
					t.Fatal(err)
				}
				took = max(took, at.Sub(damaged))
			}
			if took > HealLimit {
				t.Errorf("%s: repaired %v after the damage, more than %v", d.Name, took, HealLimit)
			}
			if !d.Repaired(ctx, t, env) {
				t.Errorf("%s: the agent logged the heal, but the damage is still there", d.Name)
			}
			// The counter and the log line follow the repair by the agent's check after it.
			if err := testutil.Poll(HealLimit, 20*time.Millisecond, func() error {
				if got := heals(ctx, t, ag); fmt.Sprint(got) != fmt.Sprint(counted) {
					return testutil.NotYet("heals_total %v, want %v", got, counted)
				}
				return nil
			}); err != nil {
				t.Errorf("%s: %v", d.Name, err)
			}
			agentTook := map[string]string{}
			for _, m := range healTookRE.FindAllStringSubmatch(ag.Logs(), -1) {
				agentTook[m[1]] = m[2] // the last heal of each kind
			}
			t.Logf("%s: repaired %v after the damage (found, then repaired in %v)", d.Name,
				took.Round(time.Millisecond), agentTook[d.What[0]])
			b.Verify(ctx, t, env)
			if t.Failed() {
				t.FailNow()
			}
		}
		// Once more, later: each heal was logged exactly once.
		time.Sleep(1500 * time.Millisecond)
		for k, n := range counted {
			if got := ag.Count("drift healed", "what="+k+" "); float64(got) != n {
				t.Errorf("%d heal lines for %s, want %v", got, k, n)
			}
		}
		if n := ag.Count("drift persists"); n != 0 {
			t.Errorf("%d lines about drift that persisted", n)
		}
		env.Check(ctx, t, want, nil)
	})
}
