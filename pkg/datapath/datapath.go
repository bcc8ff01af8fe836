// Package datapath defines what the agent needs from a datapath backend (iptables, BPF): install
// a compiled policy, report how often each rule matched, and remove everything again.
//
// The agent drives a backend from one goroutine; implementations need not be safe for
// concurrent use.
package datapath

import (
	"context"
	"net/netip"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Backend is one datapath implementation.
type Backend interface {
	// Name is the short name used in logs and on the command line ("iptables", "bpf").
	Name() string

	// Apply makes the datapath implement p, replacing whatever policy it implemented before.
	//
	//   - Idempotent: applying the same policy again is harmless and repairs drift (rules or maps
	//     changed or removed behind the agent's back), which the periodic resync relies on.
	//   - Atomic per address family: traffic sees either the old or the new rule list of a
	//     family, never a mix. The families are updated one after the other.
	//   - On error the datapath may hold the new policy for one family and the old for the other
	//     (never a half-written family); the caller retries with the same or a newer policy.
	//   - p.IPv6 == nil (IPv6 not enabled) means IPv6 traffic is left alone: the backend then
	//     installs nothing for IPv6 and may remove IPv6 state a previous run left behind.
	//   - Apply must not keep p after it returns beyond reading it; the caller does not mutate it.
	//   - Settings the node cannot honour (for example --random-fully on an iptables without it)
	//     are dropped with a warning rather than failing every apply.
	Apply(ctx context.Context, p *policy.Policy) error

	// Counters returns, for each rule of the policy last applied by this process, how many
	// packets and bytes matched it, read from the live datapath.
	//
	//   - Before the first successful Apply it returns no counters and no error.
	//   - Counters start at zero when a rule is (re)installed; they are not persisted.
	//   - A rule missing from the live datapath (drift not yet healed) is left out rather than
	//     reported as zero.
	//   - The order is the policy order: IPv4 rules by number, then IPv6 rules by number.
	Counters(ctx context.Context) ([]RuleCounter, error)

	// Cleanup removes everything this backend installs, for both address families, whether or
	// not this process installed it and whatever flags it was started with.
	//
	//   - Safe to run twice, and on a node where nothing was ever installed: absent state is
	//     not an error.
	//   - It does not need a prior Apply; a fresh backend value can clean up after an earlier
	//     process.
	//   - Traffic in flight keeps flowing; it simply stops being masqueraded by this agent.
	Cleanup(ctx context.Context) error
}

// RuleCounter is the hit count of one policy rule.
type RuleCounter struct {
	Family policy.Family
	// Rule is the rule's 1-based number in its family's list (policy.Rule.Number).
	Rule   int
	Prefix netip.Prefix
	Action policy.Action
	// Packets and Bytes are totals since the rule was installed. A rule that the datapath splits
	// into several entries (per protocol or port range) reports their sum.
	Packets uint64
	Bytes   uint64
}
