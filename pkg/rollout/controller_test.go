package rollout

import (
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// Writes that change only counts wait for the status interval; any other change is written at
// once, every agent watching the object.
func TestCountsOnly(t *testing.T) {
	base := kube.Rollout{Generation: 2, Phase: kube.RolloutProgressing, Wave: 1, Nodes: 10, Updated: 1, Reason: "waiting for node-1"}
	for _, tc := range []struct {
		name string
		edit func(r *kube.Rollout)
		want bool
	}{
		{"a node more updated", func(r *kube.Rollout) { r.Updated, r.Reason = 2, "waiting for node-2" }, true},
		{"a node more", func(r *kube.Rollout) { r.Nodes = 11 }, true},
		{"the next wave", func(r *kube.Rollout) { r.Wave = 2 }, false},
		{"halted", func(r *kube.Rollout) { r.Phase, r.Reason = kube.RolloutHalted, "node-1: rejected" }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			next := base
			tc.edit(&next)
			if got := countsOnly(base, next); got != tc.want {
				t.Errorf("countsOnly %v, want %v", got, tc.want)
			}
		})
	}
	done := kube.Rollout{Generation: 2, Phase: kube.RolloutComplete, Nodes: 10, Updated: 9, Reason: "rolled out in 3 waves"}
	later := done
	later.Updated = 10
	if !countsOnly(done, later) {
		t.Error("a node catching up after the rollout is written at once")
	}
	later.Reason = "another"
	if countsOnly(done, later) {
		t.Error("a complete rollout's reason is a count")
	}
}
