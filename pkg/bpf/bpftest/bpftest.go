// Package bpftest keeps the BPF object of every pinned-map layout that has shipped
// (testdata/layout<N>.o), and builds from them, without any of their agents' code, the pins that
// an agent of that layout would have left: its maps pinned where it pinned them, with a policy
// and an uplink written in its layout, and its programs ready to attach. Tests and benchmarks
// start the current datapath over them (the migration of package bpf).
//
// It does not import package bpf, whose own tests use it.
package bpftest

import (
	"bytes"
	"embed"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

//go:embed testdata/layout*.o
var objects embed.FS

// firstDirLayout is the first layout whose maps live in a directory of their own, <root>/vN,
// with a layout record (bpf.Layout's documentation).
const firstDirLayout = 3

// Layouts lists the layouts that have a fixture, oldest first; the last is the current one.
func Layouts() []int {
	var out []int
	for l := 1; ; l++ {
		if _, err := objects.Open(objectName(l)); err != nil {
			return out
		}
		out = append(out, l)
	}
}

// Current is the newest layout with a fixture.
func Current() int { return slices.Max(Layouts()) }

func objectName(layout int) string { return "testdata/layout" + strconv.Itoa(layout) + ".o" }

// Object is the BPF object of a layout.
func Object(layout int) ([]byte, error) {
	return objects.ReadFile(objectName(layout))
}

// Spec is the collection spec of a layout's object.
func Spec(layout int) (*ebpf.CollectionSpec, error) {
	b, err := Object(layout)
	if err != nil {
		return nil, fmt.Errorf("no fixture of layout %d: %w", layout, err)
	}
	return ebpf.LoadCollectionSpecFromReader(bytes.NewReader(b))
}

// PinDir is where an agent of layout pinned its maps under root.
func PinDir(root string, layout int) string {
	if layout < firstDirLayout {
		return root
	}
	return filepath.Join(root, "v"+strconv.Itoa(layout))
}

// Options size and fill an old datapath.
type Options struct {
	// NATEntries sizes each NAT table; MaxRules the rule maps. Zero: small defaults.
	NATEntries, MaxRules uint32
	// Sizes, when set, gives maps their max_entries by name, over the sizes above (an agent's
	// own sizes, so that a build of the current layout finds every pin it can reuse).
	Sizes map[string]uint32
	// IPv6 enables IPv6 (the default policy's IPv6 rules).
	IPv6 bool
	// Uplink is the ifindex whose SNAT addresses SNAT4 and SNAT6 (when valid) are written.
	Uplink       int
	SNAT4, SNAT6 netip.Addr
}

// Old is an older layout's datapath, loaded from its object.
type Old struct {
	Layout int
	// Dir is where its maps are pinned.
	Dir  string
	Coll *ebpf.Collection
	// Refused says why this kernel's verifier refused the layout's programs, where it did: Coll
	// then has the maps alone.
	Refused error
}

// Load loads layout's object with its maps pinned under root (the pin root,
// <bpffs>/ip-masq-agent) as an agent of that layout pinned them, and writes the default policy
// (with random ports in the default range) and the uplink's addresses in that layout, as that
// agent would have.
func Load(layout int, root string, o Options) (*Old, error) {
	return load(layout, layout, root, o)
}

// Newer is the fixture of a layout newer than every layout there is: the current layout's maps
// pinned and filled as Load does, in the directory and with the layout record of layout
// Current()+1, as a newer agent would have left them for an older one to find.
func Newer(root string, o Options) (*Old, error) {
	return load(Current(), Current()+1, root, o)
}

// load loads the object of layout with its maps pinned and recorded as layout as's.
func load(layout, as int, root string, o Options) (*Old, error) {
	// As an agent does (a kernel before 5.11 charges maps to the limit).
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, err
	}
	spec, err := Spec(layout)
	if err != nil {
		return nil, err
	}
	if o.NATEntries == 0 {
		o.NATEntries = 1 << 12
	}
	if o.MaxRules == 0 {
		o.MaxRules = 64
	}
	for name, m := range spec.Maps {
		switch name {
		case "masq_v4", "nomasq_v4", "masq_v6", "nomasq_v6", "rule_stats", "rule_slots":
			m.MaxEntries = o.MaxRules
		case "nat_v4", "nat_v6", "nat_new_v4", "nat_new_v6", "keep_v4", "keep_v6": // the last four from layout 5
			m.MaxEntries = o.NATEntries
		case "frag_v4", "frag_v6":
			m.MaxEntries = 256
		}
		if n, ok := o.Sizes[name]; ok {
			m.MaxEntries = n
		}
		m.Pinning = ebpf.PinByName
	}
	dir := PinDir(root, as)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	copts := ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}}
	coll, err := ebpf.NewCollectionWithOptions(spec, copts)
	var refused *ebpf.VerifierError
	if errors.As(err, &refused) {
		// This kernel's verifier refuses the layout's programs, so no node of it ran them; an
		// agent of that layout pinned its maps before it loaded its programs, though, and may
		// have left them: the maps alone.
		spec.Programs = nil
		coll, err = ebpf.NewCollectionWithOptions(spec, copts)
	}
	if err != nil {
		return nil, fmt.Errorf("load layout %d: %w", layout, err)
	}
	old := &Old{Layout: layout, Dir: dir, Coll: coll}
	if refused != nil {
		old.Refused = refused
	}
	if err := old.write(o, as); err != nil {
		coll.Close()
		return nil, fmt.Errorf("write layout %d: %w", layout, err)
	}
	return old, nil
}

// NeedPrograms stops a test that runs the layout's programs where this kernel refuses them
// (Refused): no node of this kernel ever ran them.
func (o *Old) NeedPrograms(t testing.TB) {
	t.Helper()
	if o.Refused != nil {
		testutil.NotOnThisKernel(t, "the programs of layout %d, which its verifier refuses (%v)", o.Layout, o.Refused)
	}
}

// Egress and Ingress are the layout's programs (nil where Refused).
func (o *Old) Egress() *ebpf.Program  { return o.Coll.Programs["tc_egress"] }
func (o *Old) Ingress() *ebpf.Program { return o.Coll.Programs["tc_ingress"] }

// Map is one of the layout's maps.
func (o *Old) Map(name string) *ebpf.Map { return o.Coll.Maps[name] }

// Close releases the programs and maps (the pins stay).
func (o *Old) Close() { o.Coll.Close() }

var originCodes = map[policy.Origin]uint8{
	policy.OriginMasqueradeCIDRs: 1, policy.OriginLinkLocal: 2, policy.OriginNonMasqueradeCIDRs: 3,
	policy.OriginOutbound: 4,
}

const noSlot = ^uint32(0)

// write writes the default policy and the uplink, in the old layout. Slots go to the rules in
// order (IPv4, then IPv6), as the agents assign them to a fresh table.
func (o *Old) write(opts Options, recordLayout int) error {
	p := policy.Compile(config.Default(config.Options{EnableIPv6: opts.IPv6}),
		policy.Options{EnableIPv6: opts.IPv6, RandomFully: true})
	l := policyLayouts[o.Layout]
	ne := binary.NativeEndian
	slot := uint32(0)
	outSlot := map[policy.Family]uint32{policy.IPv4: noSlot, policy.IPv6: noSlot}
	for _, fam := range policy.Families() {
		if !p.Enabled(fam) {
			continue
		}
		_, outbound := p.OutboundAction(fam)
		for i := range p.Rules(fam) {
			r := &p.Rules(fam)[i]
			rs := make([]byte, 24)
			copy(rs, addrBytes(r.Prefix.Addr()))
			rs[16], rs[17], rs[18], rs[19] = byte(r.Prefix.Bits()), byte(fam), byte(r.Action), originCodes[r.Origin]
			if err := o.Map("rule_slots").Put(slot, rs); err != nil {
				return err
			}
			if r == outbound {
				outSlot[fam] = slot
				slot++
				continue
			}
			trie := "nomasq_v"
			if r.Action == policy.Masquerade {
				trie = "masq_v"
			}
			trie += strconv.Itoa(int(fam))
			key := ne.AppendUint32(nil, uint32(r.Prefix.Bits()))
			key = append(key, r.Prefix.Addr().AsSlice()...)
			if err := o.Map(trie).Put(key, l.trieValue(fam, r.Action, slot)); err != nil {
				return err
			}
			slot++
		}
	}
	first, last := policy.DefaultPortRange.First, policy.DefaultPortRange.Last
	for i := uint32(0); i <= uint32(last-first); i++ {
		if err := o.Map("nat_ports").Put(i, uint16(uint32(first)+i)); err != nil {
			return err
		}
	}
	if err := o.Map("nat_config").Put(uint32(0), l.natConfig(p, outSlot)); err != nil {
		return err
	}
	if o.Layout >= firstDirLayout {
		rec := make([]byte, 20)
		copy(rec, "ip-masq-agent")
		ne.PutUint32(rec[16:], uint32(recordLayout))
		if err := o.Map("layout").Put(uint32(0), rec); err != nil {
			return err
		}
	}
	if opts.Uplink != 0 {
		u := make([]byte, 24)
		if opts.SNAT4.IsValid() {
			a := opts.SNAT4.As4()
			copy(u[0:], a[:])
			u[20] = 1
		}
		if opts.SNAT6.IsValid() && opts.IPv6 {
			a := opts.SNAT6.As16()
			copy(u[4:], a[:])
			u[21] = 1
		}
		if err := o.Map("uplink_snat").Put(uint32(opts.Uplink), u); err != nil {
			return err
		}
	}
	return nil
}

// policyLayout writes a layout's policy values.
type policyLayout struct {
	// familyCfg is the size of struct family_cfg; trieValue the trie values.
	familyCfg int
	trieValue func(fam policy.Family, action policy.Action, slot uint32) []byte
	// portSeed: nat_config holds the secret of the port sequences after nports (layout 5).
	portSeed bool
}

// policyLayouts are how each layout holds the policy (its tries' values and nat_config): a
// layout that changes them adds its entry here, one that does not reuses its predecessor's.
var policyLayouts = map[int]policyLayout{
	1: legacyPolicy, 2: legacyPolicy, 3: verdictPolicy, 4: verdictPolicy,
	5: {familyCfg: verdictPolicy.familyCfg, trieValue: verdictPolicy.trieValue, portSeed: true},
}

// verdictPolicy is layout 3's: the verdict in the trie values.
var verdictPolicy = policyLayout{familyCfg: 24, trieValue: func(fam policy.Family, action policy.Action, slot uint32) []byte {
	v := binary.NativeEndian.AppendUint32(nil, slot)
	v = append(v, byte(action), 0, 0, 0)
	return append(v, make([]byte, addrLen(fam))...) // no SNAT address of its own
}}

var legacyPolicy = policyLayout{familyCfg: 8, trieValue: func(_ policy.Family, _ policy.Action, slot uint32) []byte {
	return binary.NativeEndian.AppendUint32(nil, slot)
}}

// natConfig is struct nat_config: per family enabled, outbound, pad[2], out_slot (and from layout
// 3 a reserved address), then random_fully, nranges, pad, nports (from layout 5 the port seed)
// and the ranges.
func (l policyLayout) natConfig(p *policy.Policy, outSlot map[policy.Family]uint32) []byte {
	var v []byte
	for _, fam := range policy.Families() {
		fc := make([]byte, l.familyCfg)
		if p.Enabled(fam) {
			fc[0] = 1
		}
		if outSlot[fam] != noSlot {
			fc[1] = byte(policy.Masquerade)
		}
		binary.NativeEndian.PutUint32(fc[4:], outSlot[fam])
		v = append(v, fc...)
	}
	r := policy.DefaultPortRange
	v = append(v, 1, 1, 0, 0) // random_fully, one range
	v = binary.NativeEndian.AppendUint32(v, uint32(r.Size()))
	if l.portSeed {
		v = binary.NativeEndian.AppendUint32(v, 0x5eed5eed)
	}
	ranges := make([]byte, 16*4)
	binary.NativeEndian.PutUint16(ranges[0:], r.First)
	binary.NativeEndian.PutUint16(ranges[2:], r.Last)
	return append(v, ranges...)
}

func addrLen(fam policy.Family) int {
	if fam == policy.IPv6 {
		return 16
	}
	return 4
}

func addrBytes(a netip.Addr) []byte {
	b := make([]byte, 16)
	copy(b, a.AsSlice())
	return b
}

// userspaceMaps are the maps no program writes: an agent that touches nothing leaves their
// entries as they are (the programs that run change the others).
var userspaceMaps = []string{"layout", "masq_v4", "nomasq_v4", "masq_v6", "nomasq_v6", "nat_config",
	"nat_ports", "uplink_snat", "uplink_macs", "rule_slots", "sweep_stats"}

// PinState lists every pin under dir with the id of what it pins (a map, or a link and its
// program) and, for the maps only userspace writes, their entries: what a process that changes
// nothing leaves as it is, while programs run.
func PinState(dir string) ([]string, error) {
	var out []string
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			l, lerr := link.LoadPinnedLink(path, nil)
			if lerr != nil {
				return fmt.Errorf("%s: neither a map (%v) nor a link (%v)", path, err, lerr)
			}
			defer l.Close()
			info, err := l.Info()
			if err != nil {
				return err
			}
			out = append(out, fmt.Sprintf("%s: link %d program %d", path, info.ID, info.Program))
			return nil
		}
		defer m.Close()
		info, err := m.Info()
		if err != nil {
			return err
		}
		id, _ := info.ID()
		var entries []string
		if slices.Contains(userspaceMaps, filepath.Base(path)) {
			var k, v []byte
			it := m.Iterate()
			for it.Next(&k, &v) {
				entries = append(entries, fmt.Sprintf("%x=%x", k, v))
			}
			if err := it.Err(); err != nil {
				return err
			}
		}
		slices.Sort(entries)
		out = append(out, fmt.Sprintf("%s: map %d %v", path, id, entries))
		return nil
	})
	return out, err
}

// RunSetsIngressIfindex tells whether this kernel's BPF_PROG_TEST_RUN takes an ingress_ifindex
// for a tc program's packet (5.10's refuses it with EINVAL), which a forwarded packet has:
// probed once, with a program that returns at once. Where it cannot be told (no privileges),
// true: the runs themselves say what is wrong.
var RunSetsIngressIfindex = sync.OnceValue(func() bool {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}})
	if err != nil {
		return true
	}
	defer prog.Close()
	var skb [11]uint32 // struct __sk_buff from len to ifindex; ingress_ifindex is the tenth
	skb[9] = 1
	_, err = prog.Run(&ebpf.RunOptions{Data: make([]byte, 64), Repeat: 1, Context: skb})
	return !errors.Is(err, unix.EINVAL)
})
