// Package datapath defines what the agent needs from a datapath backend (iptables, BPF): install
// a compiled policy, report how often each rule matched, and remove everything again; and, as
// optional interfaces, what a backend may add for metrics and `dump` (its NAT table, how it is
// attached) and for drift healing (a cheap check that what it installed is still there).
//
// The agent drives Apply and Cleanup from one goroutine. The reading methods (Counters and the
// optional reporters) are also called by metric scrapes, from other goroutines, at any time:
// they must be safe to call concurrently with Apply and with each other.
package datapath

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
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
	//   - The counters of rules that stay (see Counters) are kept.
	//   - What the backend finds installed that it must not take over (the state of a newer
	//     agent, which a rollback must not destroy) fails the Apply with an error wrapping
	//     ErrRefused, before anything is changed; Info says so until an Apply succeeds.
	Apply(ctx context.Context, p *policy.Policy) error

	// Counters returns, for each rule of the policy last applied by this process, how many
	// packets and bytes matched it, read from the live datapath.
	//
	//   - Before the first successful Apply it returns no counters and no error.
	//   - A rule that stays across an Apply keeps its counters: a rule of the new policy with
	//     the same family, prefix and action as one of the old (the same origin too, where the
	//     datapath can tell origins apart) continues its predecessor's counts, whatever its
	//     position; identical rules of one list pair up in order. Rules new to the datapath
	//     start at zero, and so does a rule whose installed form changed (on iptables, for
	//     example, another --to-ports or --random-fully).
	//   - Counters live in the datapath, not in the process: an agent restart keeps them for
	//     the rules that stay. Cleanup discards them.
	//   - A rule missing from the live datapath (drift not yet healed) is left out rather than
	//     reported as zero.
	//   - The order is the policy order: IPv4 rules by number, then IPv6 rules by number.
	//   - Safe to call concurrently with Apply (a metrics scrape); during an Apply it reports
	//     the old or the new policy's rules.
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

// ChangeReporter is implemented by backends that follow changes of the node outside the
// configuration (BPF: an uplink appeared or went away, an uplink's address changed), which only
// a new Apply puts into the datapath.
//
//   - Changes returns the same channel at every call, from the backend's creation on; it is
//     never closed. Each value is a short reason, for the logs.
//   - A value asks for an Apply (agent.Options.Changes), which installs what the backend last
//     read of the node: while a reason waits to be received, later ones may be dropped.
type ChangeReporter interface {
	Changes() <-chan string
}

// Displaced is a backend whose state the agent removes once its own backend holds a policy
// (backends are exclusive): one of the others, as the registry (package backends) gives them.
type Displaced interface {
	Name() string
	// Cleanup removes everything the backend installed; absent state is not an error.
	Cleanup(ctx context.Context) error
}

// DriftChecker is implemented by backends that can tell, cheaply enough to ask every second,
// whether what their last successful Apply installed is still in place. Drift is a change
// behind the agent's back: a rule, program, map entry or pin removed or altered by hand or by
// another program. The agent asks on a ticker and, when something drifted, applies again (Apply
// repairs every kind); each kind it then finds repaired counts as one heal.
//
//   - CheckDrift compares the node with what this process last applied, not with what a new
//     Apply would install: a change that calls for a new Apply anyway (an uplink's new
//     address, a device that appeared or went away) is no drift; it reaches the agent as an
//     event of its own.
//   - It returns the kinds that drifted (DriftChain, ...), each at most once, in DriftKinds'
//     order, then the kinds no apply repairs (see Repairable); none when everything is in place,
//     and none before the first successful Apply.
//   - An error means the check could not be made, not that something drifted.
//   - It is called from the agent's loop only, never concurrently with Apply, and must stay
//     cheap on a busy node: no full dump of the node's rules, no walk of a large table.
type DriftChecker interface {
	CheckDrift(ctx context.Context) ([]string, error)
	// DriftKinds lists every kind CheckDrift can report that an apply repairs, so that metrics
	// show each at zero before its first heal.
	DriftKinds() []string
}

// Kinds of drift (the what label of the heals metric).
const (
	// DriftChain: the iptables chain, or an nftables chain, is missing or its rules differ from
	// the policy.
	DriftChain = "chain"
	// DriftJump: the POSTROUTING jump to the chain is missing or there is more than one.
	DriftJump = "jump"
	// DriftProgram: an uplink does not run our program at a hook (detached, or replaced).
	DriftProgram = "program"
	// DriftPin: a pin of a map or of a tcx link is missing or is another object; without it
	// the next agent would start over with empty maps, or lose the link when it exits.
	DriftPin = "pin"
	// DriftTrie: a rule trie's entries differ from the policy.
	DriftTrie = "trie"
	// DriftNATConfig: the outbound rule or the NAT settings (nat_config) changed.
	DriftNATConfig = "nat_config"
	// DriftUplinkAddr: an uplink's SNAT addresses (uplink_snat) changed or were removed.
	DriftUplinkAddr = "uplink_addr"
	// DriftBypassed: a program of another component ahead of ours on an uplink's hook ends the
	// chain, so ours saw none of the packets the device moved: the policy is not enforced on that
	// hook. No apply repairs it (the agent never removes others' programs): the agent reports it
	// (a warning when it starts and when it ends, /readyz) until the other program lets the
	// packets through again, and applies nothing for it.
	DriftBypassed = "bypassed"
	// DriftTable: an nftables table of the agent is missing.
	DriftTable = "table"
	// DriftSet: an nftables set is missing, or its elements differ from the policy.
	DriftSet = "set"
)

// Repairable tells whether an apply repairs a kind of drift; DriftKinds lists only those.
func Repairable(kind string) bool { return kind != DriftBypassed }

// HookReporter is implemented by backends whose programs share the uplinks' hooks with other
// components' programs (BPF). Safe to call concurrently with Apply.
type HookReporter interface {
	// Hooks reports each hook (uplink and direction) the policy is installed on, egress first,
	// uplinks by name. The agent's backend reports what its last drift check found; a Reader
	// looks for itself.
	Hooks(ctx context.Context) ([]Hook, error)
}

// Hook is one hook (an uplink's egress or ingress) our programs run on.
type Hook struct {
	Device    string
	Ifindex   int
	Direction string // "egress" or "ingress"
	// Ahead and Behind are the programs of other components on the hook, in the order they
	// run, ahead of ours (their verdict decides whether ours runs) and behind it (ours lets
	// the chain go on to them); each as "tcx program 42 \"name\"" or with a tc priority.
	Ahead, Behind []string
	// Bypassed: while a program ahead ran, ours saw none of the packets the device moved: the
	// program ahead ends the chain, and the policy is not enforced on this hook.
	Bypassed bool
	// Bypasses counts the times Bypassed started, since the process started.
	Bypasses uint64
}

// UplinkReporter is implemented by backends that attach to the devices pod traffic leaves by
// (BPF), where another backend's rules apply on whatever device a packet leaves by. Safe to call
// concurrently with Apply.
type UplinkReporter interface {
	// Uplinks reports the devices pod traffic can leave the node by, by ifindex: those the
	// policy is installed on, and those it cannot be or is not yet.
	Uplinks(ctx context.Context) ([]Uplink, error)
}

// Uplink is one device pod traffic can leave the node by.
type Uplink struct {
	Device  string
	Ifindex int
	// Via says what makes it an uplink: "default route", "route 203.0.113.0/24 table 100",
	// "--interfaces".
	Via string
	// Covered: the programs run on the device. When false, Note says why not: pod traffic
	// leaving by the device is not masqueraded.
	Covered bool
	Note    string
}

// ErrRefused marks an Apply that refused to take over what is installed on the node, such as
// BPF maps of a layout newer than the agent's (a newer agent's, which a rollback must not
// destroy): nothing was changed, and the retries succeed once that state is gone.
var ErrRefused = errors.New("refused to take over the datapath installed on the node")

// RuleCounter is the hit count of one policy rule.
type RuleCounter struct {
	// Set is the source rule whose list holds the rule (policy.Rule.Set); empty for the global
	// list. The global lists' counters come first, then each source rule's, in rule order.
	Set    string
	Family policy.Family
	// Rule is the rule's 1-based position in its family's list (as policy.Verdict.Number), or 0
	// when a Reader found an installed rule that the configuration it was given does not contain.
	Rule   int
	Prefix netip.Prefix
	Action policy.Action
	// Origin is the part of the configuration the rule came from (policy.Rule.Origin). With
	// Rule 0 it is what the datapath records, if anything: empty when it cannot tell (iptables).
	// Metrics leave out counters without an origin.
	Origin policy.Origin
	// Entry is the index within the config key the rule came from (policy.Rule.Entry), or -1
	// for link-local and outbound rules and when unknown.
	Entry int
	// Address is the source a MASQUERADE rule rewrites to, as the datapath holds it (the BPF
	// datapath's tries, the iptables chain's SNAT --to-source, the nftables chains' snat to);
	// invalid for the uplink's address and when unknown.
	Address netip.Addr
	// Packets and Bytes are totals since the rule was installed (see Backend.Counters for what
	// survives a reload). Bytes are IP packet lengths. A rule that the datapath splits into
	// several entries (per protocol or port range) reports their sum. What a packet is differs:
	// iptables' nat table sees only the first packet of each connection, the BPF datapath every
	// packet it classifies or translates.
	Packets uint64
	Bytes   uint64
}

// Source describes where the counter's rule came from, as policy.Rule.Source does for
// configured rules: "nonMasqueradeCIDRs[2]", or the origin alone when the entry is unknown.
func (c RuleCounter) Source() string {
	switch {
	case c.Origin == "":
		return "?"
	case c.Entry >= 0:
		return policy.Rule{Set: c.Set, Origin: c.Origin, Entry: c.Entry}.Source()
	case c.Set != "":
		return fmt.Sprintf("%s[%s].%s", config.KeySourceRules, c.Set, c.Origin)
	}
	return string(c.Origin)
}

// Info describes how a datapath is installed, for the datapath_info metric and `dump`.
type Info struct {
	// Backend is the backend's name, as Backend.Name.
	Backend string
	// AttachMode is how programs are attached to the uplinks: "tcx" or "tc" (clsact and
	// cls_bpf); AttachNone for a backend that attaches no programs (iptables).
	AttachMode string
	// Details is a short human-readable line for `dump`, e.g. "nft, chain IP-MASQ-AGENT"; not
	// a metric label.
	Details string
	// Refused, when not empty, says why the last Apply refused to take over what is installed
	// (ErrRefused).
	Refused string
	// Missing names the kernel features the backend would use that this node's kernel lacks
	// (probed), each with what the backend does instead: "tcx links (Linux 6.6): clsact and
	// cls_bpf filters". Empty where the kernel has them all, and for backends without any.
	Missing []string
}

// AttachNone is the AttachMode of a backend that attaches no programs.
const AttachNone = "none"

// InfoReporter is implemented by backends that can say how they are installed. A backend that
// does not implement it is reported as Info{Backend: Name(), AttachMode: AttachNone}.
//
//   - Info reads no kernel state and does not fail; before the first Apply it reports what
//     the backend will do (for example the attach mode it chose when it was created).
//   - Safe to call concurrently with Apply.
type InfoReporter interface {
	Info() Info
}

// Reader reads a datapath that is installed on the node, from any process: the agent's own
// (where the Backend is the Reader) or another one such as `dump`, while an agent runs or
// after it stopped. A Reader may also implement NATReporter.
type Reader interface {
	InfoReporter
	// Counters is Backend.Counters for the rules as installed. A Reader in another process
	// maps them to the configuration it was given; an installed rule that configuration lacks
	// is reported with Rule 0 (and the origin the datapath records, if any), after the
	// configured ones of its family.
	Counters(ctx context.Context) ([]RuleCounter, error)
}

// NATReporter is implemented by datapaths that keep a NAT table of their own (BPF; iptables
// leaves NAT to conntrack and does not implement it). Metrics and `dump` use it when present.
//
// Both methods are safe to call concurrently with Apply and with each other, and read the live
// tables each time (no cache): their cost grows with the table, so NATStats should count
// without allocating per entry. An error means nothing of the answer is usable; callers report
// what else they can.
type NATReporter interface {
	// NATStats returns the table's size and the counters of the NAT engine.
	//
	//   - Counters are totals since the datapath was created; they survive agent restarts
	//     where the datapath keeps its state (pinned maps) and may be reset by a new datapath.
	//   - Before the first Apply the table is empty and the counters may be zero.
	NATStats(ctx context.Context) (NATStats, error)

	// NATSummary walks the table for `dump`: entries by family, protocol and state, and the
	// remote endpoints that hold the most entries.
	//
	//   - top bounds Busiest; top <= 0 means none.
	//   - Entries change while they are walked: the summary is a best effort, not a snapshot.
	NATSummary(ctx context.Context, top int) (NATSummary, error)
}

// NATStats are the NAT table's metrics.
type NATStats struct {
	// Entries counts the table's entries by family, protocol and state; a flow takes one entry
	// per direction. Combinations without entries may be left out.
	Entries []NATEntries
	// Tables says how full each of the NAT's tables is, per family.
	Tables []NATTable
	// PortAllocationRetries counts port claims that found the port taken and tried another.
	PortAllocationRetries uint64
	// PortAllocationFailures counts new flows that found no free port within the retries.
	PortAllocationFailures uint64
	// PortAttempts is the histogram of the probes that successful port allocations took.
	PortAttempts Histogram
	// EstablishedEvictable counts flows that proved two-way while the table that never evicts
	// was full, and so stayed where entries are evicted: an upper bound on the established flows
	// the table can have evicted, 0 as long as the table has room.
	EstablishedEvictable uint64
	// Events counts the datapath's events by name (BPF: enum event of bpf/types.h, see
	// bpf.Event), drops among them; every event the datapath knows should be present, zero or
	// not, so the series exist before the first one.
	Events map[string]uint64
	// Drops counts dropped packets by reason (BPF: the drop events' names without "drop_",
	// such as "no_port"), with every reason present, zero or not, as in Events.
	Drops map[string]uint64
	// Swept counts the entries the periodic sweep removed as idle, by protocol (ProtocolName).
	Swept map[string]uint64
}

// NATEntries is a count of NAT table entries.
type NATEntries struct {
	Family policy.Family
	// Protocol is ProtocolName of the entries' IP protocol.
	Protocol string
	// State is the flows' state: "unreplied", "established", "closing", or "kept" (the verdict a
	// flow the policy left alone keeps).
	State   string
	Entries uint64
}

// NATTable is how full one of a family's NAT tables is.
type NATTable struct {
	Family policy.Family
	// Table names it: "confirmed" (flows that proved two-way; never evicted), "unreplied" (the
	// rest; least recently used evicted first), "keep" (kept verdicts).
	Table             string
	Entries, Capacity uint64
}

// Histogram is a histogram of counts: Counts[i] observations of at most Bounds[i] (and more
// than Bounds[i-1]), summing to Sum.
type Histogram struct {
	Bounds []float64
	Counts []uint64
	Sum    float64
}

// RemoteEndpoint is a remote address and port (the destination of the flows leaving the node)
// with the number of NAT entries toward it.
type RemoteEndpoint struct {
	Protocol string
	Endpoint netip.AddrPort
	Entries  uint64
}

// NATSummary is what `dump` shows of the NAT table.
type NATSummary struct {
	// Entries by family, protocol and state, each combination at most once.
	Entries []NATEntries
	// Busiest are the remote endpoints with the most entries, most first.
	Busiest []RemoteEndpoint
}

// ProtocolName is the label value of an IP protocol number: "tcp", "udp", "icmp", "icmpv6",
// else "other".
func ProtocolName(proto uint8) string {
	switch proto {
	case 6:
		return "tcp"
	case 17:
		return "udp"
	case 1:
		return "icmp"
	case 58:
		return "icmpv6"
	}
	return "other"
}

// Republished is how a backend publishes what an apply installed for one family to the readers
// that run meanwhile (Counters, a scrape): a copy of m with fam's value v, or without fam when v
// is nil. The map is replaced, never modified, so a reader's copy stays valid.
func Republished[V any](m map[policy.Family]*V, fam policy.Family, v *V) map[policy.Family]*V {
	next := make(map[policy.Family]*V, len(m)+1)
	for f, x := range m {
		if f != fam {
			next[f] = x
		}
	}
	if v != nil {
		next[fam] = v
	}
	return next
}
