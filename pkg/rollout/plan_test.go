package rollout

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

var (
	specGood  = json.RawMessage(`{"nonMasqueradeCIDRs":["10.0.0.0/8"]}`)
	specNew   = json.RawMessage(`{"nonMasqueradeCIDRs":["10.0.0.0/8","8.8.8.8/32"]}`)
	specOther = json.RawMessage(`{"masqOutBound":false}`)
	t0        = time.Date(2026, 12, 5, 6, 0, 0, 0, time.UTC)
)

// fleet is n nodes named node-0...
type fleet []Node

func newFleet(n int) fleet {
	f := make(fleet, n)
	for i := range f {
		f[i].Name = fmt.Sprintf("node-%d", i)
	}
	return f
}

// apply makes every node do what its agent would: apply what Pick gives it, well.
func (f fleet) apply(o Object) {
	for i := range f {
		_, gen := Pick(o.Spec, o.Generation, o.Rollout, f[i].Name)
		f[i].Status = kube.NodeStatus{State: kube.StateReady, Config: kube.ConfigStatus{Generation: gen},
			Conditions: []metav1.Condition{{Type: kube.ConditionReady, Status: metav1.ConditionTrue}}}
	}
}

// released counts the nodes that apply the spec of o's generation.
func (f fleet) released(o Object) int {
	n := 0
	for _, node := range f {
		if _, gen := Pick(o.Spec, o.Generation, o.Rollout, node.Name); gen == o.Generation {
			n++
		}
	}
	return n
}

// settle steps and applies until nothing changes at the time now; it returns the last wait.
func settle(t *testing.T, p Plan, o *Object, f fleet, now time.Time) time.Duration {
	t.Helper()
	var wait time.Duration
	for range 10 {
		var next *kube.Rollout
		next, wait, _ = p.Step(*o, f, now)
		same := o.Rollout != nil && fmt.Sprint(*next) == fmt.Sprint(*o.Rollout)
		o.Rollout = next
		f.apply(*o)
		if same {
			return wait
		}
	}
	t.Fatalf("the rollout does not settle: %+v", o.Rollout)
	return 0
}

// firstWave is a fleet of n nodes on which generation 1 (specGood) was rolled out, and
// generation 2 (specNew) whose first wave the plan has just released and its nodes applied.
func firstWave(t *testing.T, p Plan, n int) (Object, fleet) {
	t.Helper()
	f := newFleet(n)
	o := Object{Generation: 1, Spec: specGood}
	settle(t, p, &o, f, t0)
	o.Generation, o.Spec = 2, specNew
	o.Rollout, _, _ = p.Step(o, f, t0)
	f.apply(o)
	return o, f
}

func plan(waves ...int) Plan {
	return Plan{Waves: waves, Hold: time.Minute, Deadline: 5 * time.Minute}
}

// A good generation goes out in the waves' shares, each after the hold, and completes.
func TestWavesRollOut(t *testing.T) {
	p := plan(10, 50, 100)
	f := newFleet(20)
	o := Object{Generation: 1, Spec: specGood}
	settle(t, p, &o, f, t0)
	if o.Rollout.Phase != kube.RolloutComplete || o.Rollout.Stable.Generation != 1 || f.released(o) != 20 {
		t.Fatalf("the first generation: %+v, released to %d", o.Rollout, f.released(o))
	}
	o.Generation, o.Spec = 2, specNew
	now := t0.Add(time.Hour)
	for i, want := range []int{2, 10} {
		wait := settle(t, p, &o, f, now)
		if got := f.released(o); got != want || o.Rollout.Phase != kube.RolloutProgressing || o.Rollout.Wave != i+1 {
			t.Fatalf("wave %d: %d nodes released (want %d), %+v", i+1, got, want, o.Rollout)
		}
		if wait != p.Hold || !strings.Contains(o.Rollout.Reason, "holding") {
			t.Fatalf("wave %d: waits %v (want the hold), %q", i+1, wait, o.Rollout.Reason)
		}
		if o.Rollout.Updated != want || o.Rollout.Nodes != 20 {
			t.Errorf("wave %d: %d of %d updated", i+1, o.Rollout.Updated, o.Rollout.Nodes)
		}
		// The unreleased nodes keep the stable spec.
		for _, n := range f {
			if spec, gen := Pick(o.Spec, o.Generation, o.Rollout, n.Name); gen == 1 && string(spec) != string(specGood) {
				t.Fatalf("%s applies %s at generation 1", n.Name, spec)
			}
		}
		now = now.Add(p.Hold)
	}
	settle(t, p, &o, f, now)
	if o.Rollout.Phase != kube.RolloutComplete || f.released(o) != 20 || o.Rollout.Stable.Generation != 2 ||
		string(o.Rollout.Stable.Spec) != string(specNew) {
		t.Fatalf("after the last wave: %+v, released to %d", o.Rollout, f.released(o))
	}
}

// A released node that rejects the generation halts the rollout: no more waves, the rest keep
// the stable spec; a resume accepts the released nodes and sends the next wave out.
func TestRejectHaltsAndResumeGoesOn(t *testing.T) {
	p := plan(10, 50, 100)
	o, f := firstWave(t, p, 20)
	canaries := map[string]bool{}
	for i := range f {
		if _, gen := Pick(o.Spec, o.Generation, o.Rollout, f[i].Name); gen == 2 {
			canaries[f[i].Name] = true
			f[i].Status.Config.Generation = 1
			f[i].Status.Rejected = &kube.RejectedConfig{Generation: 2, Reason: "masqOutBound: bad"}
		}
	}
	later := t0.Add(time.Hour)
	next, wait, _ := p.Step(o, f, later)
	node, why, _ := strings.Cut(next.Reason, ": ")
	if next.Phase != kube.RolloutHalted || !canaries[node] || why != "rejected generation 2: masqOutBound: bad" || wait != 0 {
		t.Fatalf("after the reject: %+v, wait %v", next, wait)
	}
	o.Rollout = next
	if again, _, _ := p.Step(o, f, later.Add(time.Hour)); again.Phase != kube.RolloutHalted || again.ReleasedBelow != next.ReleasedBelow {
		t.Fatalf("a halted rollout moved on by itself: %+v", again)
	}
	o.Resume = 1 // an annotation of another generation resumes nothing
	if again, _, resumed := p.Step(o, f, later); again.Phase != kube.RolloutHalted || resumed {
		t.Fatalf("resumed by another generation's annotation: %+v", again)
	}
	o.Resume = 2
	next, _, resumed := p.Step(o, f, later)
	if !resumed || next.Phase != kube.RolloutProgressing || next.Wave != 2 || next.ExcusedBelow == 0 {
		t.Fatalf("after the resume: %+v (resumed %v)", next, resumed)
	}
	o.Rollout, o.Resume = next, 0
	f.apply(o)
	for i := range f { // the canary still rejects: excused
		if canaries[f[i].Name] {
			f[i].Status.Config.Generation = 1
			f[i].Status.Rejected = &kube.RejectedConfig{Generation: 2, Reason: "masqOutBound: bad"}
		}
	}
	if next, _, _ := p.Step(o, f, later); next.Phase != kube.RolloutProgressing {
		t.Fatalf("the excused canary halted it again: %+v", next)
	}
}

// A released node that loses its readiness halts the rollout, as one that does not apply the
// generation within the deadline does.
func TestUnwellOrLateHalts(t *testing.T) {
	p := plan(50, 100)
	for _, tc := range []struct {
		name  string
		spoil func(n *Node)
		after time.Duration
		want  string
	}{
		{"not ready", func(n *Node) {
			n.Status.Conditions = []metav1.Condition{{Type: kube.ConditionReady, Status: metav1.ConditionFalse, Message: "no uplink"}}
		}, 0, "Ready after applying generation 2: no uplink"},
		{"address missing", func(n *Node) {
			n.Status.Conditions = []metav1.Condition{{Type: kube.ConditionMasqueradeAddresses, Status: metav1.ConditionFalse, Message: "203.0.113.9 is not an address"}}
		}, 0, "MasqueradeAddressesPresent after applying generation 2"},
		{"late", func(n *Node) { n.Status.Config.Generation = 1 }, p.Deadline, "did not apply generation 2 within 5m0s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, f := firstWave(t, p, 4)
			for i := range f {
				if _, gen := Pick(o.Spec, o.Generation, o.Rollout, f[i].Name); gen == 2 {
					tc.spoil(&f[i])
				}
			}
			next, _, _ := p.Step(o, f, t0.Add(tc.after))
			if next.Phase != kube.RolloutHalted || !strings.Contains(next.Reason, tc.want) {
				t.Fatalf("%+v: want halted, %q", next, tc.want)
			}
			if tc.after > 0 {
				if early, wait, _ := p.Step(o, f, t0.Add(tc.after-time.Second)); early.Phase != kube.RolloutProgressing || wait != time.Second {
					t.Fatalf("before the deadline: %+v, wait %v", early, wait)
				}
			}
		})
	}
}

// Going back to the stable spec, and the immediate strategy, reach every node at once.
func TestAtOnce(t *testing.T) {
	p := plan(10, 100)
	o, f := firstWave(t, p, 10)
	o.Generation, o.Spec = 3, json.RawMessage(`{ "nonMasqueradeCIDRs": ["10.0.0.0/8"] }`) // the stable one, spelt otherwise
	next, _, _ := p.Step(o, f, t0)
	if next.Phase != kube.RolloutComplete || next.Stable.Generation != 3 || !strings.Contains(next.Reason, "stable configuration of generation 1") {
		t.Fatalf("back to the stable spec: %+v", next)
	}
	o.Rollout = next
	o.Generation, o.Spec = 4, specOther
	p.Immediate = true
	if next, _, _ = p.Step(o, f, t0); next.Phase != kube.RolloutComplete || next.Stable.Generation != 4 {
		t.Fatalf("immediate: %+v", next)
	}
}

// Each wave releases at least one node more; a wave that would add none is skipped, and a
// fleet smaller than the waves still goes out in steps.
func TestSmallFleets(t *testing.T) {
	for _, tc := range []struct {
		nodes int
		waves []int
		steps []int // nodes released by each wave before the last, which completes at once
	}{
		{3, []int{1, 10, 50, 100}, []int{1, 2}},
		{1, []int{1, 10, 50, 100}, nil},
		{0, []int{1, 100}, nil},
		{200, []int{1, 10, 100}, []int{2, 20}},
	} {
		t.Run(fmt.Sprint(tc.nodes, tc.waves), func(t *testing.T) {
			p := plan(tc.waves...)
			f := newFleet(tc.nodes)
			o := Object{Generation: 1, Spec: specGood}
			settle(t, p, &o, f, t0)
			o.Generation, o.Spec = 2, specNew
			now := t0
			var steps []int
			for o.Rollout.Phase != kube.RolloutComplete || o.Rollout.Generation != 2 {
				settle(t, p, &o, f, now)
				if o.Rollout.Phase == kube.RolloutProgressing {
					steps = append(steps, f.released(o))
				}
				now = now.Add(p.Hold)
				if now.Sub(t0) > time.Hour {
					t.Fatalf("no end: %+v", o.Rollout)
				}
			}
			if fmt.Sprint(steps) != fmt.Sprint(tc.steps) {
				t.Errorf("released %v, want %v", steps, tc.steps)
			}
		})
	}
}

// A node without a name (an agent without --node-name) is released only with the last wave.
func TestPickWithoutName(t *testing.T) {
	r := &kube.Rollout{Generation: 2, ReleasedBelow: kube.AllNodes - 1, Stable: &kube.StableConfig{Generation: 1, Spec: specGood}}
	if spec, gen := Pick(specNew, 2, r, ""); gen != 1 || string(spec) != string(specGood) {
		t.Errorf("before the last wave: %s, %d", spec, gen)
	}
	r.ReleasedBelow = kube.AllNodes
	if _, gen := Pick(specNew, 2, r, ""); gen != 2 {
		t.Errorf("with the last wave: %d", gen)
	}
	if _, gen := Pick(specNew, 3, r, "node-1"); gen != 1 {
		t.Errorf("a generation the controller has not seen: %d, want the stable one", gen)
	}
	if _, gen := Pick(specNew, 3, nil, "node-1"); gen != 3 {
		t.Errorf("no rollout: %d, want the spec's", gen)
	}
}

func TestParseWaves(t *testing.T) {
	if w, err := ParseWaves(" 1, 10,100"); err != nil || fmt.Sprint(w) != "[1 10 100]" {
		t.Errorf("%v, %v", w, err)
	}
	for _, bad := range []string{"", "10,5,100", "1,50", "0,100", "1,x,100", "1,101"} {
		if _, err := ParseWaves(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
