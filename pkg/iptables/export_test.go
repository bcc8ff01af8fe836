package iptables

// Internals the external tests (package iptables_test, which can use iptablestest) look at.
const (
	ProbeChain       = probeChain
	KubeletHintChain = kubeletHintChain
)
