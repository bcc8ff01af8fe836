// Package rollout rolls a new generation of an IPMasqAgentConfig's spec out to the fleet in
// waves: a small share of the nodes first, then more, each wave only after the nodes already
// released applied the generation and stayed well for a hold time. A released node that rejects
// it, loses its readiness or does not apply it in time halts the rollout, and every node not yet
// released keeps the last generation rolled out to all (the stable one).
//
// The controller is the only one that watches the nodes' statuses; an agent reads only the one
// object it already watches, whose status says which nodes are released (a bound on a hash of
// the node's name, so that nothing grows with the fleet) and what the stable configuration is.
// Pick is the agent's half, Plan.Step the controller's: a pure function of the object, the
// nodes' statuses and the time.
package rollout

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// Defaults of a Plan, and of the controller's flags.
const (
	// DefaultWaves: 1% of the nodes (at least one), then 10%, 50% and all.
	DefaultWaves = "1,10,50,100"
	// DefaultHold is how long a wave's nodes stay well before the next wave: long enough for a
	// wrong configuration to show (readiness probes, drift checks), short enough that four waves
	// take minutes.
	DefaultHold = 2 * time.Minute
	// DefaultDeadline is how long a wave's nodes have to apply the generation: a status is
	// written within seconds of an apply, so a node that takes longer is in trouble.
	DefaultDeadline = 10 * time.Minute
)

// Plan is how a generation is rolled out.
type Plan struct {
	// Waves are the cumulative shares of the nodes released by each wave, in percent, rising,
	// the last 100. Each wave releases at least one node more than the one before.
	Waves []int
	// Hold is how long the released nodes must stay well before the next wave.
	Hold time.Duration
	// Deadline is how long a wave's nodes have to apply the generation.
	Deadline time.Duration
	// Immediate releases every generation to every node at once (no waves).
	Immediate bool
}

// ParseWaves reads a --waves value: rising percentages, comma-separated, ending at 100.
func ParseWaves(s string) ([]int, error) {
	var waves []int
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 100 {
			return nil, fmt.Errorf("waves %q: %q is not a percentage from 1 to 100", s, f)
		}
		if len(waves) > 0 && n <= waves[len(waves)-1] {
			return nil, fmt.Errorf("waves %q: each wave's share must be larger than the one before", s)
		}
		waves = append(waves, n)
	}
	if len(waves) == 0 || waves[len(waves)-1] != 100 {
		return nil, fmt.Errorf("waves %q: the last wave must be 100", s)
	}
	return waves, nil
}

// NodeHash places a node in the waves: the FNV-1a hash of its name, the same in the controller
// and in every agent, and spread evenly, so that the first waves take nodes from everywhere.
func NodeHash(node string) int64 {
	h := fnv.New32a()
	h.Write([]byte(node))
	return int64(h.Sum32())
}

// Pick is the configuration a node applies: the spec of generation gen when no rollout governs
// the object, or when the rollout is of gen and has released the node; else the stable one. It
// returns the spec and its generation. A node without a name is released with the last wave.
func Pick(spec json.RawMessage, gen int64, r *kube.Rollout, node string) (json.RawMessage, int64) {
	released := r != nil && r.Generation == gen &&
		(r.ReleasedBelow == kube.AllNodes || node != "" && NodeHash(node) < r.ReleasedBelow)
	if r == nil || r.Stable == nil || released {
		return spec, gen
	}
	return r.Stable.Spec, r.Stable.Generation
}

// Node is a node that runs an agent, and its agent's status.
type Node struct {
	Name   string
	Status kube.NodeStatus
}

// Object is what the controller reads of the IPMasqAgentConfig.
type Object struct {
	Generation int64
	// Spec is the spec as JSON, nil for none.
	Spec json.RawMessage
	// Rollout is the status's, nil before the controller's first write.
	Rollout *kube.Rollout
	// Resume is the generation kube.ResumeAnnotation names, 0 for none.
	Resume int64
}

// Step is the rollout's next state, given the object, the nodes and the time. wait is how long
// until a step is due even if nothing changes (a hold or a deadline ends), 0 for none; resumed
// is true when the step acted on the resume annotation, which the controller then removes.
func (p Plan) Step(o Object, nodes []Node, now time.Time) (next *kube.Rollout, wait time.Duration, resumed bool) {
	var r kube.Rollout
	if o.Rollout != nil {
		r = *o.Rollout
	}
	r.Waves = len(p.Waves)
	switch {
	case o.Rollout == nil || r.Stable == nil:
		p.complete(&r, o, now, "the first generation the controller saw: there was none to keep")
	case r.Generation != o.Generation && p.Immediate:
		p.complete(&r, o, now, "immediate: every node applies it at once")
	case r.Generation != o.Generation && sameSpec(o.Spec, r.Stable.Spec):
		p.complete(&r, o, now, fmt.Sprintf("the stable configuration of generation %d again: every node applies it at once", r.Stable.Generation))
	case r.Generation != o.Generation:
		r = kube.Rollout{Generation: o.Generation, Phase: kube.RolloutProgressing, Waves: len(p.Waves), Stable: r.Stable}
		p.release(&r, nodes, now)
	case r.Phase == kube.RolloutHalted && o.Resume == r.Generation:
		// The operator accepts the released nodes as they are: their health is no longer
		// checked, and the next wave goes out at once.
		r.ExcusedBelow, r.Phase, r.Reason = r.ReleasedBelow, kube.RolloutProgressing, ""
		p.release(&r, nodes, now)
		resumed = true
	}
	if r.Phase == kube.RolloutProgressing {
		wait = p.progress(&r, o, nodes, now)
	}
	count(&r, nodes)
	return &r, wait, resumed
}

// progress checks the released nodes: one unwell halts the rollout; once all applied the
// generation and stayed well for the hold, the next wave goes out (or, when all are released,
// the rollout completes). It returns how long until the hold or the deadline ends.
func (p Plan) progress(r *kube.Rollout, o Object, nodes []Node, now time.Time) time.Duration {
	var waiting []string
	for _, n := range nodes {
		if h := NodeHash(n.Name); h >= r.ReleasedBelow || h < r.ExcusedBelow {
			continue
		}
		if why := unwell(n.Status, r.Generation); why != "" {
			halt(r, now, n.Name+": "+why)
			return 0
		}
		if n.Status.Config.Generation != r.Generation {
			waiting = append(waiting, n.Name)
		}
	}
	if len(waiting) > 0 {
		r.HealthySince = nil
		left := p.Deadline - now.Sub(r.Since.Time)
		if left <= 0 {
			halt(r, now, fmt.Sprintf("%s did not apply generation %d within %v", list(waiting), r.Generation, p.Deadline))
			return 0
		}
		r.Reason = fmt.Sprintf("wave %d of %d: waiting for %s to apply generation %d", r.Wave, r.Waves, list(waiting), r.Generation)
		return left
	}
	if r.ReleasedBelow == kube.AllNodes {
		p.complete(r, o, now, fmt.Sprintf("rolled out in %d waves", r.Wave))
		return 0
	}
	if r.HealthySince == nil {
		r.HealthySince = stamp(now)
	}
	if left := p.Hold - now.Sub(r.HealthySince.Time); left > 0 {
		r.Reason = fmt.Sprintf("wave %d of %d: every released node applied generation %d; holding for %v", r.Wave, r.Waves,
			r.Generation, p.Hold)
		return left
	}
	p.release(r, nodes, now)
	return p.Deadline
}

// release sends out the next wave: the released share of the nodes grows to the wave's, by at
// least one node (a wave that would add none is skipped).
func (p Plan) release(r *kube.Rollout, nodes []Node, now time.Time) {
	hashes := make([]int64, len(nodes))
	for i, n := range nodes {
		hashes[i] = NodeHash(n.Name)
	}
	slices.Sort(hashes)
	for r.Wave < len(p.Waves) {
		r.Wave++
		k := int(math.Ceil(float64(p.Waves[r.Wave-1]) * float64(len(hashes)) / 100))
		below := kube.AllNodes
		if r.Wave < len(p.Waves) && k < len(hashes) {
			below = hashes[max(k, 1)-1] + 1
		}
		if below == kube.AllNodes {
			r.Wave = len(p.Waves)
		}
		if below > r.ReleasedBelow {
			r.ReleasedBelow = below
			break
		}
	}
	r.Since, r.HealthySince, r.Reason = *stamp(now), nil, ""
}

// complete makes o's generation the stable one, which every node applies.
func (p Plan) complete(r *kube.Rollout, o Object, now time.Time, why string) {
	*r = kube.Rollout{Generation: o.Generation, Phase: kube.RolloutComplete, Wave: len(p.Waves), Waves: len(p.Waves),
		ReleasedBelow: kube.AllNodes, Since: *stamp(now), Reason: why,
		Stable: &kube.StableConfig{Generation: o.Generation, Spec: o.Spec}}
}

func halt(r *kube.Rollout, now time.Time, why string) {
	r.Phase, r.Reason, r.Since, r.HealthySince = kube.RolloutHalted, why, *stamp(now), nil
}

// stamp is now as the status keeps it, in whole seconds, rounded up: a hold measured from it is
// never shorter than the plan's, and the state read back equals the state written.
func stamp(now time.Time) *metav1.Time {
	t := now.Truncate(time.Second)
	if t.Before(now) {
		t = t.Add(time.Second)
	}
	return &metav1.Time{Time: t.UTC()}
}

// count sets how many nodes there are, and how many applied the rollout's generation.
func count(r *kube.Rollout, nodes []Node) {
	r.Nodes, r.Updated = len(nodes), 0
	for _, n := range nodes {
		if n.Status.Config.Generation == r.Generation {
			r.Updated++
		}
	}
}

// haltingConditions are the conditions of a node's status that halt a rollout when false after
// the node applied (or read) the generation: those a configuration can break. A fallback backend
// or a full NAT table are the node's own.
var haltingConditions = []string{kube.ConditionReady, kube.ConditionConfigAccepted, kube.ConditionMasqueradeAddresses,
	kube.ConditionEnforced}

// unwell says what is wrong with a node since it read generation gen, "" when nothing is (or it
// has not read it yet).
func unwell(st kube.NodeStatus, gen int64) string {
	if st.Rejected != nil && st.Rejected.Generation == gen {
		return fmt.Sprintf("rejected generation %d: %s", gen, st.Rejected.Reason)
	}
	if st.Config.Generation != gen {
		return ""
	}
	for _, c := range st.Conditions {
		if c.Status == metav1.ConditionFalse && slices.Contains(haltingConditions, c.Type) {
			return fmt.Sprintf("%s after applying generation %d: %s", c.Type, gen, c.Message)
		}
	}
	return ""
}

// list names a few nodes: "node-1, node-2 and 3 more".
func list(names []string) string {
	const shown = 3
	slices.Sort(names)
	if len(names) <= shown {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:shown], ", "), len(names)-shown)
}

// sameSpec tells whether two specs are the same document, whatever their keys' order.
func sameSpec(a, b json.RawMessage) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return bytes.Equal(a, b)
	}
	ca, _ := json.Marshal(x)
	cb, _ := json.Marshal(y)
	return bytes.Equal(ca, cb)
}
