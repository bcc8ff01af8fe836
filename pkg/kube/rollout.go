package kube

import (
	"encoding/json"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ConfigObjectStatus is the status of an IPMasqAgentConfig: the rollout of its spec, which the
// rollout controller (ip-masq-agent rollout) writes and every agent reads
// (deploy/crds/ipmasqagentconfigs.yaml is its schema; a test keeps the two in step).
type ConfigObjectStatus struct {
	Rollout *Rollout `json:"rollout,omitempty"`
}

// Rollout is where the rollout of a generation of the spec stands. A node applies the spec when
// the rollout is of the spec's generation and has released the node (NodeHash(node) <
// ReleasedBelow), else the stable configuration; an object without a rollout (no controller)
// is applied by every node at once.
type Rollout struct {
	// Generation is the spec's generation being rolled out, or last rolled out.
	Generation int64 `json:"generation"`
	// Phase is one of the Rollout phases.
	Phase string `json:"phase"`
	// Wave is how many of the Waves have been released; Waves how many there are.
	Wave  int `json:"wave"`
	Waves int `json:"waves"`
	// ReleasedBelow is the bound of the released nodes' NodeHash: from 0 (none) to AllNodes.
	ReleasedBelow int64 `json:"releasedBelow"`
	// ExcusedBelow: the health of nodes below it is not checked: they were released before a
	// resume, which accepted their state.
	ExcusedBelow int64 `json:"excusedBelow,omitempty"`
	// Nodes is how many nodes run an agent (have an IPMasqAgentNode); Updated how many of them
	// applied Generation.
	Nodes   int `json:"nodes"`
	Updated int `json:"updated"`
	// Since is when the current wave was released (or the phase began); HealthySince when every
	// released node was last seen to have applied the generation and be well, the start of the
	// hold.
	Since        metav1.Time  `json:"since"`
	HealthySince *metav1.Time `json:"healthySince,omitempty"`
	// Reason says why the rollout halted, or what it waits for.
	Reason string `json:"reason,omitempty"`
	// Stable is the configuration the nodes not released apply: the last generation rolled
	// out to every node.
	Stable *StableConfig `json:"stable,omitempty"`
}

// Phases of a Rollout.
const (
	// RolloutProgressing: waves are being released, each after the previous one's nodes applied
	// the generation and stayed well for the hold time.
	RolloutProgressing = "Progressing"
	// RolloutHalted: a released node rejected the generation, lost its readiness or did not
	// apply it in time; no more waves are released until an operator resumes or rolls back.
	RolloutHalted = "Halted"
	// RolloutComplete: every node applies the generation, which is now the stable one.
	RolloutComplete = "Complete"
)

// AllNodes is the ReleasedBelow that releases every node, whatever its hash.
const AllNodes = int64(1) << 32

// StableConfig is a generation of the spec that every node applied.
type StableConfig struct {
	Generation int64 `json:"generation"`
	// Spec is the spec of that generation; null for an object without one (the defaults).
	Spec json.RawMessage `json:"spec,omitempty"`
}

// ResumeAnnotation on an IPMasqAgentConfig resumes a halted rollout: its value is the
// generation to resume, so that an annotation left behind resumes no later rollout.
const ResumeAnnotation = Group + "/resume-rollout"
