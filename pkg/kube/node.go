package kube

import metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

// NodeStatus is the status of an IPMasqAgentNode: what the agent of the node it is named after
// applied, and what keeps it from being well (deploy/crds/ipmasqagentnodes.yaml is its schema;
// a test keeps the two in step).
type NodeStatus struct {
	// State sums the node up (the State values).
	State string `json:"state"`
	// Message says what keeps the node from being Ready, the first problem; empty when Ready.
	Message string `json:"message,omitempty"`
	// AgentVersion is the agent's version.
	AgentVersion string `json:"agentVersion"`
	// Config is the configuration in force; Rejected, while there is one, the latest the agent
	// read and refused.
	Config   ConfigStatus    `json:"config"`
	Rejected *RejectedConfig `json:"rejected,omitempty"`
	Backend  BackendStatus   `json:"backend"`
	// Conditions say, one aspect each (the Condition types), whether it is well.
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// LastHeartbeatTime is when the agent last wrote the status: at each change, and every
	// --node-status-heartbeat when nothing changes, so that the row of a node whose agent is
	// gone stops being fresh.
	LastHeartbeatTime *metav1.Time `json:"lastHeartbeatTime,omitempty"`
}

// States of a node.
const (
	// StateReady: the configuration in force is the latest, enforced everywhere, on the backend
	// of choice.
	StateReady = "Ready"
	// StateDegraded: ready, but with a problem that does not stop it: the latest configuration
	// rejected (the one in force stays), a fallback backend, a NAT table almost full.
	StateDegraded = "Degraded"
	// StateNotReady: /readyz fails.
	StateNotReady = "NotReady"
)

// Condition types of a node's status.
const (
	// ConditionReady is what /readyz says.
	ConditionReady = "Ready"
	// ConditionConfigAccepted is false while the latest configuration is rejected.
	ConditionConfigAccepted = "ConfigAccepted"
	// ConditionMasqueradeAddresses is false while a masquerade address of the configuration is
	// not on the node.
	ConditionMasqueradeAddresses = "MasqueradeAddressesPresent"
	// ConditionEnforced is false while drift persists (see agent.Stats.Unenforced, Persisting).
	ConditionEnforced = "Enforced"
	// ConditionNATRoom is false while a NAT table is almost full (BPF).
	ConditionNATRoom = "NATTableHasRoom"
	// ConditionPreferredBackend is false while --backend=auto runs a fallback.
	ConditionPreferredBackend = "PreferredBackend"
	// ConditionConfigObjectPresent is false (reason ReasonConfigObjectDeleted) while the API
	// object the configuration is read from is deleted, and the last configuration applied
	// stays in force; only for --config-source configmap or crd.
	ConditionConfigObjectPresent = "ConfigObjectPresent"
)

// ReasonConfigObjectDeleted is ConditionConfigObjectPresent's reason while the object is deleted.
const ReasonConfigObjectDeleted = "ConfigObjectDeleted"

// ConfigStatus is the configuration in force.
type ConfigStatus struct {
	// Source is where it comes from: the file's path, or the API object.
	Source string `json:"source"`
	// Hash is the start (16 hex digits) of the SHA-256 of its canonical form, which
	// ip_masq_agent_config_info's sha256 label holds whole.
	Hash string `json:"hash,omitempty"`
	// ResourceVersion and Generation are the object's it was read from (the generation of an
	// IPMasqAgentConfig; a ConfigMap has none).
	ResourceVersion string `json:"resourceVersion,omitempty"`
	Generation      int64  `json:"generation,omitempty"`
}

// HashLength is how many hex digits of the configuration's SHA-256 ConfigStatus.Hash keeps.
const HashLength = 16

// RejectedConfig is the latest configuration read, which the agent refused.
type RejectedConfig struct {
	ResourceVersion string `json:"resourceVersion,omitempty"`
	Generation      int64  `json:"generation,omitempty"`
	// Reason is the first problems, as the agent's log tells them all.
	Reason string `json:"reason"`
}

// BackendStatus is the datapath in force.
type BackendStatus struct {
	Name       string `json:"name"`
	AttachMode string `json:"attachMode,omitempty"`
	// Reason is why it runs: named by --backend, or what auto found.
	Reason string `json:"reason,omitempty"`
	// Fallback is true when auto passed over a backend that cannot run on the node.
	Fallback bool `json:"fallback,omitempty"`
	// MissingFeatures are the kernel features the backend does without on this node, each
	// with what it does instead (datapath.Info's Missing).
	MissingFeatures []string `json:"missingFeatures,omitempty"`
}

// Node is an IPMasqAgentNode, as the agent writes it.
type Node struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Status            NodeStatus `json:"status"`
}
