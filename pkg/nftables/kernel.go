package nftables

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"time"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

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
	// read only when elements is set: a walk of every set, whose cost grows with them.
	Table(ctx context.Context, fam policy.Family, elements bool) (*TableState, error)
	// TableNames lists a family's tables, of every owner.
	TableNames(ctx context.Context, fam policy.Family) ([]string, error)
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

// batchTimeout bounds an element batch whose context has no earlier deadline: the kernel
// answers every message of a batch, but a reply lost would otherwise leave the apply waiting.
const batchTimeout = time.Minute

// maxElementsMessage bounds the elements' bytes in one netlink message: the kernel takes them in
// one nested attribute, whose length is 16 bits.
const maxElementsMessage = 60000

// elementBytes is an upper bound of what an element takes in a message: its key and comment
// with their attribute headers and padding.
func elementBytes(e gnft.SetElement) int { return 48 + len(e.Key) + len(e.Comment) }

// inMessages passes elems to send in runs that each fit a message.
func inMessages(elems []gnft.SetElement, send func([]gnft.SetElement) error) error {
	start, bytes := 0, 0
	for i, e := range elems {
		if bytes+elementBytes(e) > maxElementsMessage && i > start {
			if err := send(elems[start:i]); err != nil {
				return err
			}
			start, bytes = i, 0
		}
		bytes += elementBytes(e)
	}
	if start < len(elems) {
		return send(elems[start:])
	}
	return nil
}

// ChangeElements implements Kernel: one netlink batch (nfnetlink's BATCH_BEGIN ... BATCH_END,
// the kernel's transaction) of element messages, each set's split to fit a message. Elements get
// their set's counter from the kernel, which gives every element added without expressions a
// copy of its set's.
func (NetlinkKernel) ChangeElements(ctx context.Context, fam policy.Family, changes []SetChange) error {
	size := 0
	dels, adds := make([][]gnft.SetElement, len(changes)), make([][]gnft.SetElement, len(changes))
	for i, ch := range changes {
		for _, k := range ch.Delete {
			dels[i] = append(dels[i], gnft.SetElement{Key: k.AsSlice()})
			size += elementBytes(dels[i][len(dels[i])-1])
		}
		for _, e := range ch.Add {
			adds[i] = append(adds[i], gnft.SetElement{Key: e.Key.AsSlice(), Comment: e.Comment})
			size += elementBytes(adds[i][len(adds[i])-1])
		}
	}
	// The whole batch goes in one sendmsg, which the socket's send buffer must hold; the
	// answers are an acknowledgement per message, without the message (CapAcknowledge).
	c, err := gnft.New(gnft.WithSockOptions(func(c *netlink.Conn) error {
		if err := c.SetOption(netlink.CapAcknowledge, true); err != nil {
			return err
		}
		if err := c.SetWriteBuffer(2*size + 1<<20); err != nil {
			return err
		}
		deadline := time.Now().Add(batchTimeout)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		return c.SetDeadline(deadline)
	}))
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	table := &gnft.Table{Name: TableName, Family: tableFamily(fam)}
	for i, ch := range changes {
		set := &gnft.Set{Table: table, Name: ch.Set}
		if ch.Flush {
			c.FlushSet(set)
		}
		del := func(e []gnft.SetElement) error { return c.SetDeleteElements(set, e) }
		add := func(e []gnft.SetElement) error { return c.SetAddElements(set, e) }
		if err := inMessages(dels[i], del); err != nil {
			return err
		}
		if err := inMessages(adds[i], add); err != nil {
			return err
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("change the elements of %s %s: %w", nftFamily(fam), TableName, err)
	}
	return nil
}
