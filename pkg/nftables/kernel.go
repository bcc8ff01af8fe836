package nftables

import (
	"context"
	"net/netip"
	"slices"
	"time"

	gnft "github.com/google/nftables"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Kernel reads what the tables hold, and changes their sets' elements, beside the knftables
// transactions that change the rest.
//
// The reads go over netlink, with the library knftables links for its own (UseNetlink) reads,
// rather than through knftables' List calls: those run `nft list`, which nft 1.0.6 answers by
// fetching every element of every set first (5 s for `nft list chain` next to a 100k-element
// set here, under load), and they do not return element counters. The elements go over netlink
// too: nft parses a line per element, which took 2-4 s of a 100k-element apply here, where the
// kernel's own work is a fraction of it.
type Kernel interface {
	// Generation is the ruleset's generation: every committed nftables transaction on the node,
	// in any table, changes it. An unchanged generation means nothing changed.
	Generation(ctx context.Context) (uint32, error)
	// Table reads a family's table, nil when there is none. Elements (and their counters) are
	// read only when elements is set: a walk of every set, whose cost grows with the square of
	// its elements, and which misses some of a set the kernel is resizing (see Elements).
	Table(ctx context.Context, fam policy.Family, elements bool) (*TableState, error)
	// TableNames lists a family's tables, of every owner.
	TableNames(ctx context.Context, fam policy.Family) ([]string, error)
	// Elements reads the named elements of a family's set, by key: those present, each with its
	// comment and counter. Its cost grows with the keys, where a Table with elements walks every
	// element of every set.
	Elements(ctx context.Context, fam policy.Family, set string, keys []netip.Addr) (map[netip.Addr]ElementState, error)
	// ChangeElements changes the elements of sets of a family's table in one batch, which the
	// kernel commits as one transaction: all of it or, on an error, nothing. A packet sees the
	// sets as they were before the batch or as they are after it.
	ChangeElements(ctx context.Context, fam policy.Family, changes []SetChange) error
}

// SetChange is what an element batch does to one set, in this order: every element removed
// (Flush), the Delete keys removed, the Add elements added.
type SetChange struct {
	Set    string
	Flush  bool
	Delete []netip.Addr
	Add    []NewElement
}

// NewElement is an element to add: its key and comment.
type NewElement struct {
	Key     netip.Addr
	Comment string
}

// KubeProxyTable is the table kube-proxy's nftables mode keeps, in both families.
const KubeProxyTable = "kube-proxy"

// KubeProxyTables returns the families ("ip", "ip6") that hold kube-proxy's nftables table:
// kube-proxy runs in nftables mode when there is one. kernel nil reads over netlink.
func KubeProxyTables(ctx context.Context, kernel Kernel) ([]string, error) {
	if kernel == nil {
		kernel = NetlinkKernel{}
	}
	var out []string
	for _, fam := range policy.Families() {
		names, err := kernel.TableNames(ctx, fam)
		if err != nil {
			return nil, err
		}
		if slices.Contains(names, KubeProxyTable) {
			out = append(out, string(nftFamily(fam)))
		}
	}
	return out, nil
}

// TableState is what a family's table holds.
type TableState struct {
	// Sets by name; a set's Elements is nil when they were not read.
	Sets map[string]*SetState
	// Outbound is the outbound counter, nil when there is none; SourceOutbound the source
	// rules' outbound counters, by source rule name.
	Outbound       *Count
	SourceOutbound map[string]Count
	// Chains holds, per chain that exists, a fingerprint of each of its rules: equal
	// fingerprints from one Kernel mean equal rules. The source rules' chains are those the
	// source map goes to.
	Chains map[string][]string
	// SourceMap holds a fingerprint of each element of the source map, sorted; nil when there
	// is no map. Equal fingerprints from one Kernel mean equal elements.
	SourceMap []string
	// SNAT holds the address a masquerade set's lookup, or an outbound rule (under its counter's
	// name), rewrites to: the `snat to` of the chain it goes to. Absent where that chain
	// masquerades to the uplink's address.
	SNAT map[string]netip.Addr
}

// SetState is one set's elements.
type SetState struct {
	Elements map[netip.Addr]ElementState
}

// ElementState is one element: its comment and counter.
type ElementState struct {
	Comment string
	Count   Count
}

// Count is a counter's value.
type Count struct {
	Packets, Bytes uint64
}

// NetlinkKernel reads the tables of the caller's network namespace over netlink.
type NetlinkKernel struct{}

var _ Kernel = NetlinkKernel{}

func tableFamily(fam policy.Family) gnft.TableFamily {
	if fam == policy.IPv6 {
		return gnft.TableFamilyIPv6
	}
	return gnft.TableFamilyIPv4
}

// batchTimeout bounds a netlink exchange whose context has no earlier deadline (an element
// batch, an element request): the kernel answers every message, but a reply lost would otherwise
// leave the apply waiting.
const batchTimeout = time.Minute

// deadline is when an exchange under ctx gives up: ctx's deadline, at most batchTimeout away.
func deadline(ctx context.Context) time.Time {
	d := time.Now().Add(batchTimeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		d = cd
	}
	return d
}
