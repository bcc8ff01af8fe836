package iptables

// Internals the external tests (package iptables_test, which can use iptablestest) look at.
const (
	ProbeChain       = probeChain
	KubeletHintChain = kubeletHintChain
)

// The chain reading, for the tests against the real tools.
var (
	ReadChains      = readChains
	ListChain       = listChain
	ResolveTools    = resolveTools
	ParseListedRule = parseListedRule
)
