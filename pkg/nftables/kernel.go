package nftables

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"time"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
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
	// SNAT holds the address a masquerade set's lookup in the base chain, or the outbound rule
	// (under CounterOutbound), rewrites to: the `snat to` of the chain it goes to. Absent where
	// that chain masquerades to the uplink's address.
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
	st := &TableState{Sets: map[string]*SetState{}, Chains: map[string][]string{}, SNAT: map[string]netip.Addr{}}
	// Where the base chain's lookups go, and what each chain SNATs to: st.SNAT once all are read.
	gotos, snatTo := map[string]string{}, map[string]netip.Addr{}
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
			if name == ChainPostrouting {
				if key, to := lookupGoto(r.Exprs); key != "" && to != "" {
					gotos[key] = to
				}
			} else if addr, ok := snatAddress(r.Exprs); ok {
				snatTo[name] = addr
			}
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
	for key, chain := range gotos {
		if addr, ok := snatTo[chain]; ok {
			st.SNAT[key] = addr
		}
	}
	// The element dumps on sockets whose reads take a full message each (see largeDumps).
	dumps, err := gnft.New(gnft.WithSockOptions(largeDumps))
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
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
		elems, err := dumps.GetSetElements(s)
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

// lookupGoto reads a rule of the base chain: the set it looks the destination up in
// (CounterOutbound for the outbound rule, whatever gate set it has) and the chain it goes to;
// empty for what it does not have.
func lookupGoto(exprs []expr.Any) (key, chain string) {
	for _, e := range exprs {
		switch e := e.(type) {
		case *expr.Lookup:
			if key == "" {
				key = e.SetName
			}
		case *expr.Objref:
			if e.Name == CounterOutbound {
				key = CounterOutbound
			}
		case *expr.Verdict:
			if e.Kind == expr.VerdictGoto {
				chain = e.Chain
			}
		}
	}
	return key, chain
}

// snatAddress reads the address an SNAT rule rewrites to: the immediate its nat expression
// takes the address from. ok is false for other rules and for a range of addresses.
func snatAddress(exprs []expr.Any) (netip.Addr, bool) {
	regs := map[uint32][]byte{}
	for _, e := range exprs {
		switch e := e.(type) {
		case *expr.Immediate:
			regs[e.Register] = e.Data
		case *expr.NAT:
			if e.Type != expr.NATTypeSourceNAT || e.RegAddrMin == 0 ||
				(e.RegAddrMax != 0 && !bytes.Equal(regs[e.RegAddrMax], regs[e.RegAddrMin])) {
				return netip.Addr{}, false
			}
			return netip.AddrFromSlice(regs[e.RegAddrMin])
		}
	}
	return netip.Addr{}, false
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

// elementsPerRequest bounds the keys of one element request: the kernel answers each key with a
// message of its own, about 4 KB of socket buffer, and drops (ENOBUFS) what does not fit.
const elementsPerRequest = 1000

// Elements implements Kernel with element requests (NFT_MSG_GETSETELEM without NLM_F_DUMP):
// the kernel looks each key up and answers it, where a dump of the set walks it from its
// start again for every message it fills (2.5-5 s for a 100k-element set here, in full
// messages; 1-4 s this way), and misses elements of a set it is resizing. It stops at a key
// it does not hold (ENOENT): the keys after it are asked again.
func (NetlinkKernel) Elements(ctx context.Context, fam policy.Family, set string, keys []netip.Addr) (map[netip.Addr]ElementState, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	defer c.Close()
	deadline := time.Now().Add(batchTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if err := c.SetDeadline(deadline); err != nil {
		return nil, err
	}
	if err := c.SetOption(netlink.CapAcknowledge, true); err != nil {
		return nil, err
	}
	if err := c.SetReadBuffer(8 * elementsPerRequest << 10); err != nil {
		return nil, err
	}
	// The answers are read from the socket in this goroutine: the library's reads go through
	// a goroutine of their own, two thread switches for each of a read's thousands of answers.
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	buf := make([]byte, os.Getpagesize())
	read := func() (int, error) {
		var n int
		var rerr error
		if err := raw.Read(func(fd uintptr) bool {
			n, _, rerr = unix.Recvfrom(int(fd), buf, 0)
			return rerr != unix.EAGAIN
		}); err != nil {
			return 0, err
		}
		return n, rerr
	}
	family := byte(tableFamily(fam))
	out := make(map[netip.Addr]ElementState, len(keys))
	for len(keys) > 0 {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		ask := keys[:min(len(keys), elementsPerRequest)]
		ae := netlink.NewAttributeEncoder()
		ae.String(unix.NFTA_SET_ELEM_LIST_TABLE, TableName)
		ae.String(unix.NFTA_SET_ELEM_LIST_SET, set)
		ae.Nested(unix.NFTA_SET_ELEM_LIST_ELEMENTS, func(ae *netlink.AttributeEncoder) error {
			for _, k := range ask {
				ae.Nested(unix.NFTA_LIST_ELEM, func(ae *netlink.AttributeEncoder) error {
					ae.Nested(unix.NFTA_SET_ELEM_KEY, func(ae *netlink.AttributeEncoder) error {
						ae.Bytes(unix.NFTA_DATA_VALUE, k.AsSlice())
						return nil
					})
					return nil
				})
			}
			return nil
		})
		data, err := ae.Encode()
		if err != nil {
			return nil, err
		}
		if _, err := c.Send(netlink.Message{
			Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETSETELEM),
				Flags: netlink.Request | netlink.Acknowledge},
			Data: append([]byte{family, unix.NFNETLINK_V0, 0, 0}, data...),
		}); err != nil {
			return nil, fmt.Errorf("ask for the elements of %s %s %s: %w", nftFamily(fam), TableName, set, err)
		}
		answered, done := 0, false
		for !done {
			n, err := read()
			if err != nil {
				return nil, fmt.Errorf("read the elements of %s %s %s: %w", nftFamily(fam), TableName, set, err)
			}
			for b := buf[:n]; len(b) >= unix.NLMSG_HDRLEN; {
				// nlmsghdr: length, type, flags, sequence, port.
				size := int(binary.NativeEndian.Uint32(b[0:4]))
				if size < unix.NLMSG_HDRLEN || size > len(b) {
					return nil, fmt.Errorf("read the elements of %s: a message of %d bytes in %d", set, size, len(b))
				}
				typ, data := binary.NativeEndian.Uint16(b[4:6]), b[unix.NLMSG_HDRLEN:size]
				b = b[min(len(b), nlmsgAlign(size)):]
				switch {
				case typ == unix.NLMSG_ERROR && len(data) >= 4:
					done = true
					switch code := -int32(binary.NativeEndian.Uint32(data[0:4])); code {
					case 0:
					case int32(unix.ENOENT):
						answered++ // ask[answered] is not in the set: ask again for the keys after it
					default:
						return nil, fmt.Errorf("read the elements of %s %s %s: %w", nftFamily(fam), TableName, set, unix.Errno(code))
					}
				case typ == unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWSETELEM:
					key, e, err := decodeElement(data)
					if err != nil {
						return nil, fmt.Errorf("set %s: %w", set, err)
					}
					out[key] = e
					answered++
				}
			}
		}
		keys = keys[min(answered, len(keys)):]
		if answered == 0 {
			keys = keys[len(ask):] // cannot happen: an answer or an error per key
		}
	}
	return out, nil
}

// nlmsgAlign rounds a netlink message's length up to its alignment.
func nlmsgAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

// decodeElement reads an element answer (the data of an NFT_MSG_NEWSETELEM holding one
// element): its key, comment and counter.
func decodeElement(data []byte) (netip.Addr, ElementState, error) {
	var key netip.Addr
	var e ElementState
	if len(data) < 4 {
		return key, e, fmt.Errorf("an element answer of %d bytes", len(data))
	}
	ad, err := netlink.NewAttributeDecoder(data[4:])
	if err != nil {
		return key, e, err
	}
	ad.ByteOrder = binary.BigEndian
	nested := func(f func(ad *netlink.AttributeDecoder) error) func([]byte) error {
		return func(b []byte) error {
			ad, err := netlink.NewAttributeDecoder(b)
			if err != nil {
				return err
			}
			ad.ByteOrder = binary.BigEndian
			if err := f(ad); err != nil {
				return err
			}
			return ad.Err()
		}
	}
	element := func(ad *netlink.AttributeDecoder) error {
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_SET_ELEM_KEY:
				ad.Do(nested(func(ad *netlink.AttributeDecoder) error {
					for ad.Next() {
						if ad.Type() == unix.NFTA_DATA_VALUE {
							key, _ = netip.AddrFromSlice(ad.Bytes())
						}
					}
					return nil
				}))
			case unix.NFTA_SET_ELEM_USERDATA:
				e.Comment, _ = userdata.GetString(ad.Bytes(), userdata.NFTNL_UDATA_SET_ELEM_COMMENT)
			case unix.NFTA_SET_ELEM_EXPR:
				ad.Do(nested(func(ad *netlink.AttributeDecoder) error {
					for ad.Next() {
						if ad.Type() == unix.NFTA_EXPR_DATA {
							ad.Do(nested(func(ad *netlink.AttributeDecoder) error {
								for ad.Next() {
									switch ad.Type() {
									case unix.NFTA_COUNTER_BYTES:
										e.Count.Bytes = ad.Uint64()
									case unix.NFTA_COUNTER_PACKETS:
										e.Count.Packets = ad.Uint64()
									}
								}
								return nil
							}))
						}
					}
					return nil
				}))
			}
		}
		return nil
	}
	for ad.Next() {
		if ad.Type() == unix.NFTA_SET_ELEM_LIST_ELEMENTS {
			ad.Do(nested(func(ad *netlink.AttributeDecoder) error {
				for ad.Next() {
					if ad.Type() == unix.NFTA_LIST_ELEM {
						ad.Do(nested(element))
					}
				}
				return nil
			}))
		}
	}
	if err := ad.Err(); err != nil {
		return key, e, err
	}
	if !key.IsValid() {
		return key, e, errors.New("an element answer without a key")
	}
	return key, e, nil
}

// dumpMessage is the largest message the kernel fills for a dump (32 KB less its overhead).
const dumpMessage = 32 << 10

// largeDumps makes the kernel fill dump messages of dumpMessage on the socket: it sizes them
// by the largest read the socket has made, and the netlink library reads exactly what the
// next message holds, so the messages stay at the 4 KB of the first. A dump of a set walks it
// from its start for each message, which made a 100k-element dump take 35-40 s in 4 KB
// messages here. One read of dumpMessage (the answer to a generation request) sets it.
func largeDumps(c *netlink.Conn) error {
	req, err := c.Send(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN), Flags: netlink.Request},
		Data:   []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return err
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	buf := make([]byte, dumpMessage)
	var n int
	var rerr error
	if err := raw.Read(func(fd uintptr) bool {
		n, _, rerr = unix.Recvfrom(int(fd), buf, 0)
		return rerr != unix.EAGAIN
	}); err != nil {
		return err
	}
	if rerr != nil {
		return rerr
	}
	// nlmsghdr: length, type, flags, sequence.
	if n < 16 || binary.NativeEndian.Uint32(buf[8:12]) != req.Header.Sequence {
		return fmt.Errorf("an answer of %d bytes to the generation request", n)
	}
	return nil
}
