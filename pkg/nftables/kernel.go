package nftables

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Kernel reads what the tables hold, beside the knftables transactions that change them.
//
// The reads go over netlink, with the library knftables links for its own (UseNetlink) reads,
// rather than through knftables' List calls: those run `nft list`, which nft 1.0.6 answers by
// fetching every element of every set first (5 s for `nft list chain` next to a 100k-element
// set here, under load), and they do not return element counters.
type Kernel interface {
	// Generation is the ruleset's generation: every committed nftables transaction on the node,
	// in any table, changes it. An unchanged generation means nothing changed.
	Generation(ctx context.Context) (uint32, error)
	// Table reads a family's table, nil when there is none. Elements (and their counters) are
	// read only when elements is set: a walk of every set, whose cost grows with them.
	Table(ctx context.Context, fam policy.Family, elements bool) (*TableState, error)
	// TableNames lists a family's tables, of every owner.
	TableNames(ctx context.Context, fam policy.Family) ([]string, error)
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
	for _, fam := range families {
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
	// Outbound is the outbound counter, nil when there is none.
	Outbound *Count
	// Chains holds, per chain that exists, a fingerprint of each of its rules: equal
	// fingerprints from one Kernel mean equal rules.
	Chains map[string][]string
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

// Generation implements Kernel with NFT_MSG_GETGEN, which the netlink library does not wrap.
func (NetlinkKernel) Generation(ctx context.Context) (uint32, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return 0, fmt.Errorf("netlink: %w", err)
	}
	defer c.Close()
	if d, ok := ctx.Deadline(); ok {
		if err := c.SetDeadline(d); err != nil {
			return 0, err
		}
	}
	msgs, err := c.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN), Flags: netlink.Request},
		// nfgenmsg: family, version, resource id.
		Data: []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return 0, fmt.Errorf("read the nftables generation: %w", err)
	}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return 0, err
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == unix.NFTA_GEN_ID {
				return ad.Uint32(), nil
			}
		}
	}
	return 0, fmt.Errorf("read the nftables generation: no generation in the answer")
}

func tableFamily(fam policy.Family) gnft.TableFamily {
	if fam == policy.IPv6 {
		return gnft.TableFamilyIPv6
	}
	return gnft.TableFamilyIPv4
}

// TableNames implements Kernel.
func (NetlinkKernel) TableNames(_ context.Context, fam policy.Family) ([]string, error) {
	c, err := gnft.New()
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	tables, err := c.ListTablesOfFamily(tableFamily(fam))
	if err != nil {
		return nil, fmt.Errorf("list %s tables: %w", nftFamily(fam), err)
	}
	var out []string
	for _, t := range tables {
		out = append(out, t.Name)
	}
	return out, nil
}

// Table implements Kernel. A context deadline is not enforced inside the library's calls; each
// is one netlink request on a socket of its own.
func (NetlinkKernel) Table(ctx context.Context, fam policy.Family, elements bool) (*TableState, error) {
	c, err := gnft.New()
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	family := tableFamily(fam)
	tables, err := c.ListTablesOfFamily(family)
	if err != nil {
		return nil, fmt.Errorf("list %s tables: %w", nftFamily(fam), err)
	}
	var t *gnft.Table
	for _, tt := range tables {
		if tt.Name == TableName {
			t = tt
		}
	}
	if t == nil {
		return nil, nil
	}
	st := &TableState{Sets: map[string]*SetState{}, Chains: map[string][]string{}}
	// The agent's chains by name: listing every chain of the family would read kube-proxy's
	// thousands too. A chain that cannot be looked up is missing (the table could be listed;
	// the rules of a chain that does not exist read as none). The SNAT chains are numbered
	// from 1: they are read up to the first that does not exist.
	read := func(name string) (bool, error) {
		if _, err := c.ListChain(t, name); err != nil {
			return false, nil
		}
		ch := &gnft.Chain{Name: name, Table: t}
		rules, err := c.GetRules(t, ch)
		if err != nil {
			return false, fmt.Errorf("list the rules of %s %s %s: %w", nftFamily(fam), TableName, name, err)
		}
		prints := []string{}
		for _, r := range rules {
			prints = append(prints, fingerprint(ch, r))
		}
		st.Chains[name] = prints
		return true, nil
	}
	for _, name := range []string{ChainPostrouting, ChainMasq} {
		if _, err := read(name); err != nil {
			return nil, err
		}
	}
	for i := 0; ; i++ {
		found, err := read(SNATChainName(i))
		if err != nil {
			return nil, err
		}
		if !found {
			break
		}
	}
	sets, err := c.GetSets(t)
	if err != nil {
		return nil, fmt.Errorf("list %s sets: %w", nftFamily(fam), err)
	}
	for _, s := range sets {
		if s.Anonymous {
			continue // the { tcp, udp, sctp } of a rule
		}
		ss := &SetState{}
		st.Sets[s.Name] = ss
		if !elements {
			continue
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		elems, err := c.GetSetElements(s)
		if err != nil {
			return nil, fmt.Errorf("list the elements of %s %s %s: %w", nftFamily(fam), TableName, s.Name, err)
		}
		ss.Elements = make(map[netip.Addr]ElementState, len(elems))
		for _, e := range elems {
			key, ok := netip.AddrFromSlice(e.Key)
			if !ok {
				return nil, fmt.Errorf("set %s: element key %x is no address", s.Name, e.Key)
			}
			es := ElementState{Comment: e.Comment}
			if e.Counter != nil {
				es.Count = Count{Packets: e.Counter.Packets, Bytes: e.Counter.Bytes}
			}
			ss.Elements[key] = es
		}
	}
	objs, err := c.GetNamedObjects(t)
	if err != nil {
		return nil, fmt.Errorf("list %s counters: %w", nftFamily(fam), err)
	}
	for _, o := range objs {
		if no, ok := o.(*gnft.NamedObj); ok && no.Name == CounterOutbound && no.Type == gnft.ObjTypeCounter {
			if cnt, ok := no.Obj.(*expr.Counter); ok {
				st.Outbound = &Count{Packets: cnt.Packets, Bytes: cnt.Bytes}
			}
		}
	}
	return st, nil
}

// fingerprint is a rule's expressions and user data (its comment) as text: equal for equal
// rules. A counter's values are left out: they change with traffic, not with the rule.
func fingerprint(ch *gnft.Chain, r *gnft.Rule) string {
	exprs := make([]any, 0, len(r.Exprs))
	for _, e := range r.Exprs {
		if _, ok := e.(*expr.Counter); ok {
			exprs = append(exprs, "counter")
			continue
		}
		exprs = append(exprs, map[string]any{fmt.Sprintf("%T", e): e})
	}
	data, err := json.Marshal(struct {
		Chain    string
		Exprs    []any
		UserData []byte
	}{ch.Name, exprs, r.UserData})
	if err != nil {
		return fmt.Sprintf("unprintable rule %d: %v", r.Handle, err)
	}
	return string(data)
}
