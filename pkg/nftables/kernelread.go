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
	"strings"
	"syscall"

	gnft "github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The reader of NetlinkKernel: the generation, the tables, their chains, sets, elements and
// counters. Its own requests (elements by key, the dump size) are answered through receive, the
// one receive loop; the rest through the netlink library.

// Generation implements Kernel with NFT_MSG_GETGEN, which the netlink library does not wrap.
func (NetlinkKernel) Generation(ctx context.Context) (uint32, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return 0, fmt.Errorf("netlink: %w", err)
	}
	defer func() { _ = c.Close() }() // a request answered: nothing left to lose
	if d, ok := ctx.Deadline(); ok {
		if err := c.SetDeadline(d); err != nil {
			return 0, err
		}
	}
	msgs, err := c.Execute(generationRequest())
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

// generationRequest is NFT_MSG_GETGEN.
func generationRequest() netlink.Message {
	return netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN), Flags: netlink.Request},
		// nfgenmsg: family, version, resource id.
		Data: []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	}
}

// TableNames implements Kernel.
func (NetlinkKernel) TableNames(_ context.Context, fam policy.Family) ([]string, error) {
	_, tables, err := listTables(fam)
	if err != nil {
		return nil, err
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
	r, err := openTable(fam)
	if err != nil || r == nil {
		return nil, err
	}
	if err := r.readSets(ctx, elements); err != nil {
		return nil, err
	}
	if err := r.readChains(); err != nil {
		return nil, err
	}
	return r.st, r.readOutbound()
}

// listTables lists the family's tables, on a connection of its own.
func listTables(fam policy.Family) (*gnft.Conn, []*gnft.Table, error) {
	c, err := gnft.New()
	if err != nil {
		return nil, nil, fmt.Errorf("netlink: %w", err)
	}
	tables, err := c.ListTablesOfFamily(tableFamily(fam))
	if err != nil {
		return nil, nil, fmt.Errorf("list %s tables: %w", nftFamily(fam), err)
	}
	return c, tables, nil
}

// tableReader reads the agent's table of one family.
type tableReader struct {
	c   *gnft.Conn
	t   *gnft.Table
	fam policy.Family
	st  *TableState
	// sourceChains are the chains the source map goes to.
	sourceChains []string
}

// openTable finds the family's table of the agent: nil when there is none.
func openTable(fam policy.Family) (*tableReader, error) {
	c, tables, err := listTables(fam)
	if err != nil {
		return nil, err
	}
	for _, t := range tables {
		if t.Name == TableName {
			st := &TableState{Sets: map[string]*SetState{}, Chains: map[string][]string{}, SNAT: map[string]netip.Addr{},
				SourceOutbound: map[string]Count{}}
			return &tableReader{c: c, t: t, fam: fam, st: st}, nil
		}
	}
	return nil, nil
}

// readChains reads the agent's chains by name (listing every chain of the family would read
// kube-proxy's thousands too): the base chain, the masquerade chain, the SNAT chains, numbered
// from 1, up to the first that does not exist, and the chains the source map goes to; and then
// where each lookup goes and what it SNATs to (TableState.SNAT).
func (r *tableReader) readChains() error {
	gotos, snatTo := map[string]string{}, map[string]netip.Addr{}
	for _, name := range append([]string{ChainPostrouting, ChainMasq}, r.sourceChains...) {
		if _, err := r.readChain(name, gotos, snatTo); err != nil {
			return err
		}
	}
	for i := 0; ; i++ {
		found, err := r.readChain(SNATChainName(i), gotos, snatTo)
		if err != nil {
			return err
		}
		if !found {
			break
		}
	}
	for key, chain := range gotos {
		if addr, ok := snatTo[chain]; ok {
			r.st.SNAT[key] = addr
		}
	}
	return nil
}

// readChain reads a chain's rules' fingerprints, the base chain's gotos and the other chains'
// SNAT addresses, and tells whether the chain exists. A chain that cannot be looked up is
// missing (the table could be listed; the rules of a chain that does not exist read as none).
func (r *tableReader) readChain(name string, gotos map[string]string, snatTo map[string]netip.Addr) (bool, error) {
	if _, err := r.c.ListChain(r.t, name); err != nil {
		return false, nil
	}
	ch := &gnft.Chain{Name: name, Table: r.t}
	rules, err := r.c.GetRules(r.t, ch)
	if err != nil {
		return false, fmt.Errorf("list the rules of %s %s %s: %w", nftFamily(r.fam), TableName, name, err)
	}
	prints := []string{}
	for _, rule := range rules {
		prints = append(prints, fingerprint(ch, rule))
		if name == ChainPostrouting || strings.HasPrefix(name, ChainSourcePrefix) {
			if key, to := lookupGoto(rule.Exprs); key != "" && to != "" {
				gotos[key] = to
			}
		} else if addr, ok := snatAddress(rule.Exprs); ok {
			snatTo[name] = addr
		}
	}
	r.st.Chains[name] = prints
	return true, nil
}

// readSets lists the table's named sets, and with elements each one's elements and counters,
// through dumps on a socket whose reads take a full message each (see largeDumps).
func (r *tableReader) readSets(ctx context.Context, elements bool) error {
	dumps, err := gnft.New(gnft.WithSockOptions(largeDumps))
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	sets, err := r.c.GetSets(r.t)
	if err != nil {
		return fmt.Errorf("list %s sets: %w", nftFamily(r.fam), err)
	}
	for _, s := range sets {
		if s.Anonymous {
			continue // the { tcp, udp, sctp } of a rule
		}
		if s.Name == SourceMapName {
			if err := r.readSourceMap(dumps, s); err != nil {
				return err
			}
			continue
		}
		ss := &SetState{}
		r.st.Sets[s.Name] = ss
		if !elements {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		elems, err := dumps.GetSetElements(s)
		if err != nil {
			return fmt.Errorf("list the elements of %s %s %s: %w", nftFamily(r.fam), TableName, s.Name, err)
		}
		ss.Elements = make(map[netip.Addr]ElementState, len(elems))
		for _, e := range elems {
			key, ok := netip.AddrFromSlice(e.Key)
			if !ok {
				return fmt.Errorf("set %s: element key %x is no address", s.Name, e.Key)
			}
			es := ElementState{Comment: e.Comment}
			if e.Counter != nil {
				es.Count = Count{Packets: e.Counter.Packets, Bytes: e.Counter.Bytes}
			}
			ss.Elements[key] = es
		}
	}
	return nil
}

// readSourceMap reads the source map's elements, always (they are few): their fingerprints,
// and the chains they go to.
func (r *tableReader) readSourceMap(dumps *gnft.Conn, s *gnft.Set) error {
	elems, err := dumps.GetSetElements(s)
	if err != nil {
		return fmt.Errorf("list the elements of %s %s %s: %w", nftFamily(r.fam), TableName, s.Name, err)
	}
	r.st.SourceMap = []string{}
	chains := map[string]bool{}
	for _, e := range elems {
		to, err := verdictChain(e.Val)
		if err != nil {
			return fmt.Errorf("%s %s %s: element %x: %w", nftFamily(r.fam), TableName, s.Name, e.Key, err)
		}
		if to != "" && !chains[to] {
			chains[to] = true
			r.sourceChains = append(r.sourceChains, to)
		}
		r.st.SourceMap = append(r.st.SourceMap, fmt.Sprintf("%x end=%v %x", e.Key, e.IntervalEnd, e.Val))
	}
	slices.Sort(r.st.SourceMap)
	slices.Sort(r.sourceChains)
	return nil
}

// verdictChain reads the chain of a verdict map element's data, as the netlink library leaves it
// (the attributes of NFTA_DATA_VERDICT): "" for a verdict without a chain, and for none (an
// interval's end).
func verdictChain(data []byte) (string, error) {
	if len(data) == 0 {
		return "", nil
	}
	chain := ""
	err := decodeAttrs(data, func(ad *netlink.AttributeDecoder) error {
		for ad.Next() {
			if ad.Type() == unix.NFTA_VERDICT_CHAIN {
				chain = ad.String()
			}
		}
		return nil
	})
	return chain, err
}

// readOutbound reads the outbound counters.
func (r *tableReader) readOutbound() error {
	objs, err := r.c.GetNamedObjects(r.t)
	if err != nil {
		return fmt.Errorf("list %s counters: %w", nftFamily(r.fam), err)
	}
	for _, o := range objs {
		no, ok := o.(*gnft.NamedObj)
		if !ok || no.Type != gnft.ObjTypeCounter {
			continue
		}
		cnt, ok := no.Obj.(*expr.Counter)
		if !ok {
			continue
		}
		switch rule, own := parseSourceName(no.Name); {
		case no.Name == CounterOutbound:
			r.st.Outbound = &Count{Packets: cnt.Packets, Bytes: cnt.Bytes}
		case rule != "" && own == CounterOutbound:
			r.st.SourceOutbound[rule] = Count{Packets: cnt.Packets, Bytes: cnt.Bytes}
		}
	}
	return nil
}

// lookupGoto reads a rule of the base chain or a source chain: the set it looks the destination
// up in (the counter's name for an outbound rule, whatever gate set it has) and the chain it
// goes to; empty for what it does not have.
func lookupGoto(exprs []expr.Any) (key, chain string) {
	for _, e := range exprs {
		switch e := e.(type) {
		case *expr.Lookup:
			if key == "" {
				key = e.SetName
			}
		case *expr.Objref:
			if _, own := parseSourceName(e.Name); own == CounterOutbound {
				key = e.Name
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
	defer func() { _ = c.Close() }() // a request answered: nothing left to lose
	if err := c.SetDeadline(deadline(ctx)); err != nil {
		return nil, err
	}
	if err := c.SetOption(netlink.CapAcknowledge, true); err != nil {
		return nil, err
	}
	if err := c.SetReadBuffer(8 * elementsPerRequest << 10); err != nil {
		return nil, err
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	buf := make([]byte, os.Getpagesize())
	out := make(map[netip.Addr]ElementState, len(keys))
	for len(keys) > 0 {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		ask := keys[:min(len(keys), elementsPerRequest)]
		req, err := elementRequest(fam, set, ask)
		if err != nil {
			return nil, err
		}
		if _, err := c.Send(req); err != nil {
			return nil, fmt.Errorf("ask for the elements of %s %s %s: %w", nftFamily(fam), TableName, set, err)
		}
		answered, err := readElements(raw, buf, out)
		if err != nil {
			return nil, fmt.Errorf("read the elements of %s %s %s: %w", nftFamily(fam), TableName, set, err)
		}
		keys = keys[min(answered, len(keys)):]
		if answered == 0 {
			keys = keys[len(ask):] // cannot happen: an answer or an error per key
		}
	}
	return out, nil
}

// elementRequest asks for the elements of keys in set.
func elementRequest(fam policy.Family, set string, keys []netip.Addr) (netlink.Message, error) {
	ae := netlink.NewAttributeEncoder()
	ae.String(unix.NFTA_SET_ELEM_LIST_TABLE, TableName)
	ae.String(unix.NFTA_SET_ELEM_LIST_SET, set)
	ae.Nested(unix.NFTA_SET_ELEM_LIST_ELEMENTS, func(ae *netlink.AttributeEncoder) error {
		for _, k := range keys {
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
		return netlink.Message{}, err
	}
	return netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETSETELEM),
			Flags: netlink.Request | netlink.Acknowledge},
		Data: append([]byte{byte(tableFamily(fam)), unix.NFNETLINK_V0, 0, 0}, data...),
	}, nil
}

// readElements reads the answers to an element request into out, up to its acknowledgement or
// error, and returns how many keys were answered: those found, and the one it stopped at
// (ENOENT, a key the set does not hold).
func readElements(raw syscall.RawConn, buf []byte, out map[netip.Addr]ElementState) (int, error) {
	answered, done := 0, false
	for !done {
		err := receive(raw, buf, func(typ uint16, _ uint32, data []byte) error {
			switch {
			case typ == unix.NLMSG_ERROR && len(data) >= 4:
				done = true
				switch code := -int32(binary.NativeEndian.Uint32(data[0:4])); code {
				case 0:
				case int32(unix.ENOENT):
					answered++ // not in the set: the keys after it are asked again
				default:
					return unix.Errno(code)
				}
			case typ == unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWSETELEM:
				key, e, err := decodeElement(data)
				if err != nil {
					return err
				}
				out[key] = e
				answered++
			}
			return nil
		})
		if err != nil {
			return answered, err
		}
	}
	return answered, nil
}

// receive is the one receive loop of the reader's own requests: it reads one datagram from the
// socket into buf, in the calling goroutine (the library's reads go through a goroutine of
// their own, two thread switches for each of a read's thousands of answers), and calls fn with
// each netlink message in it: its type, sequence and data.
func receive(raw syscall.RawConn, buf []byte, fn func(typ uint16, seq uint32, data []byte) error) error {
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
	for b := buf[:n]; len(b) >= unix.NLMSG_HDRLEN; {
		// nlmsghdr: length, type, flags, sequence, port.
		size := int(binary.NativeEndian.Uint32(b[0:4]))
		if size < unix.NLMSG_HDRLEN || size > len(b) {
			return fmt.Errorf("a message of %d bytes in %d", size, len(b))
		}
		typ, seq, data := binary.NativeEndian.Uint16(b[4:6]), binary.NativeEndian.Uint32(b[8:12]), b[unix.NLMSG_HDRLEN:size]
		b = b[min(len(b), nlmsgAlign(size)):]
		if err := fn(typ, seq, data); err != nil {
			return err
		}
	}
	return nil
}

// nlmsgAlign rounds a netlink message's length up to its alignment.
func nlmsgAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

// decodeElement reads an element answer (the data of an NFT_MSG_NEWSETELEM holding one
// element): its key, comment and counter.
func decodeElement(data []byte) (netip.Addr, ElementState, error) {
	var el element
	if len(data) < 4 {
		return el.key, el.state, fmt.Errorf("an element answer of %d bytes", len(data))
	}
	err := decodeAttrs(data[4:], within(unix.NFTA_SET_ELEM_LIST_ELEMENTS, within(unix.NFTA_LIST_ELEM, el.decode)))
	if err != nil {
		return el.key, el.state, err
	}
	if !el.key.IsValid() {
		return el.key, el.state, errors.New("an element answer without a key")
	}
	return el.key, el.state, nil
}

// element is what decodeElement reads of an element.
type element struct {
	key   netip.Addr
	state ElementState
}

// decode reads an element's attributes: its key, its comment, and the counter among its
// expressions.
func (el *element) decode(ad *netlink.AttributeDecoder) error {
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_SET_ELEM_KEY:
			ad.Do(nested(func(ad *netlink.AttributeDecoder) error {
				for ad.Next() {
					if ad.Type() == unix.NFTA_DATA_VALUE {
						el.key, _ = netip.AddrFromSlice(ad.Bytes())
					}
				}
				return nil
			}))
		case unix.NFTA_SET_ELEM_USERDATA:
			el.state.Comment, _ = userdata.GetString(ad.Bytes(), userdata.NFTNL_UDATA_SET_ELEM_COMMENT)
		case unix.NFTA_SET_ELEM_EXPR:
			ad.Do(nested(within(unix.NFTA_EXPR_DATA, el.decodeCounter)))
		}
	}
	return nil
}

// decodeCounter reads a counter expression's data.
func (el *element) decodeCounter(ad *netlink.AttributeDecoder) error {
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_COUNTER_BYTES:
			el.state.Count.Bytes = ad.Uint64()
		case unix.NFTA_COUNTER_PACKETS:
			el.state.Count.Packets = ad.Uint64()
		}
	}
	return nil
}

// decodeAttrs runs f over the attributes in b (nftables' are big-endian), and returns its
// error or the decoder's.
func decodeAttrs(b []byte, f func(ad *netlink.AttributeDecoder) error) error {
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

// nested is decodeAttrs as an AttributeDecoder.Do of a nested attribute.
func nested(f func(ad *netlink.AttributeDecoder) error) func([]byte) error {
	return func(b []byte) error { return decodeAttrs(b, f) }
}

// within decodes the nested attributes of type typ with f, and passes over the others.
func within(typ uint16, f func(ad *netlink.AttributeDecoder) error) func(ad *netlink.AttributeDecoder) error {
	return func(ad *netlink.AttributeDecoder) error {
		for ad.Next() {
			if ad.Type() == typ {
				ad.Do(nested(f))
			}
		}
		return nil
	}
}

// dumpMessage is the largest message the kernel fills for a dump (32 KB less its overhead).
const dumpMessage = 32 << 10

// largeDumps makes the kernel fill dump messages of dumpMessage on the socket: it sizes them
// by the largest read the socket has made, and the netlink library reads exactly what the
// next message holds, so the messages stay at the 4 KB of the first. A dump of a set walks it
// from its start for each message, which made a 100k-element dump take 35-40 s in 4 KB
// messages here. One read of dumpMessage (the answer to a generation request) sets it.
func largeDumps(c *netlink.Conn) error {
	req, err := c.Send(generationRequest())
	if err != nil {
		return err
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	answered := false
	err = receive(raw, make([]byte, dumpMessage), func(_ uint16, seq uint32, _ []byte) error {
		answered = answered || seq == req.Header.Sequence
		return nil
	})
	if err == nil && !answered {
		err = errors.New("no answer to the generation request")
	}
	return err
}
