package bpf

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// The lifecycle of the pinned datapath, in one place: Open is what an agent does when it starts
// (its layout's maps, at the sizes asked, taking over what earlier agents pinned), Grow what it
// does when a policy outgrows the rule maps, OpenReadOnly what `dump` does, RemovePinned what
// `cleanup` does, and Load, beneath them, makes or reuses the maps at LoadOptions' sizes and
// loads the programs. layout.go says what a layout is, migrate.go how entries are carried.

// Defaults of LoadOptions.
const (
	DefaultNATEntries  = 1 << 18
	DefaultFragEntries = 8192
)

// Next to a confirmed table of n entries, the table of unreplied flows has n/2 and the table of
// kept verdicts (one entry per flow) n/4, never fewer than minSideEntries: a flood of unanswered
// flows churns through the room of the unreplied, while the confirmed keep theirs.
const minSideEntries = 1024

func unrepliedEntries(n uint32) uint32 { return max(n/2, minSideEntries) }
func keepEntries(n uint32) uint32      { return max(n/4, minSideEntries) }

// inboundEntries sizes the table of connections from outside that wait for a reply to show the
// node translated their destination (bpf/maps.h: inbound_v4): n/16, at least minSideEntries.
func inboundEntries(n uint32) uint32 { return max(n/16, minSideEntries) }

// heldEntries sizes each family's room for later fragments that wait for their first one (bpf/
// frag.h), from the fragment table's size: 256 at the default. It is allocated as fragments are
// held, up to FRAG_HELD_BYTES each.
func heldEntries(frag uint32) uint32 { return max(frag/32, 8) }

// LoadOptions size the maps; they are fixed once the maps exist.
type LoadOptions struct {
	// MaxRules is the number of rule counter slots, shared by both families; it bounds the rules
	// of a policy (SyncPolicy fails beyond it) and the capacity of each trie.
	MaxRules uint32
	// NATEntries is the size of each family's table of confirmed flows, which nothing evicts
	// (a flow takes two entries, one per direction); the table of unreplied flows gets half as
	// many, the table of kept verdicts a quarter. NATMemory says what they cost.
	NATEntries uint32
	// NATEntriesV6, when set, sizes the IPv6 tables instead of NATEntries: the tables are
	// preallocated, so a node without IPv6 masquerading can keep them small.
	NATEntriesV6 uint32
	// FragEntries bounds, per family, the datagrams whose later fragments can be translated at
	// once.
	FragEntries uint32
	// PinPath, when set, pins every map by name in that directory (on a bpffs) and reuses maps
	// already pinned there, so an agent restart keeps flows, rules and counters. Reusing fails
	// with an error wrapping ebpf.ErrMapIncompatible when the pinned maps have other sizes. A
	// directory that does not exist is made whole, with every map and the layout record, in a
	// staging directory renamed into place (see LayoutDir for the one the agent uses).
	PinPath string
}

func (o LoadOptions) withDefaults() LoadOptions {
	if o.MaxRules == 0 {
		o.MaxRules = DefaultMaxRules()
	}
	if o.NATEntries == 0 {
		o.NATEntries = DefaultNATEntries
	}
	if o.FragEntries == 0 {
		o.FragEntries = DefaultFragEntries
	}
	if o.NATEntriesV6 == 0 {
		o.NATEntriesV6 = o.NATEntries
	}
	return o
}

// spec is the collection spec with the maps sized by o (which has its defaults).
func (o LoadOptions) spec() (*ebpf.CollectionSpec, error) {
	spec, err := loadMasq()
	if err != nil {
		return nil, fmt.Errorf("load bpf spec: %w", err)
	}
	var m masqMapSpecs
	if err := spec.Assign(&m); err != nil {
		return nil, fmt.Errorf("load bpf spec: %w", err)
	}
	for _, rules := range []*ebpf.MapSpec{m.MasqV4, m.NomasqV4, m.MasqV6, m.NomasqV6, m.RuleStats, m.RuleSlots,
		m.RmasqV4, m.RnomasqV4, m.RmasqV6, m.RnomasqV6, m.SlotSource} {
		rules.MaxEntries = o.MaxRules
	}
	m.SrcV4.MaxEntries, m.SrcV6.MaxEntries = maxSourceEntries, maxSourceEntries
	m.NatV4.MaxEntries, m.NatV6.MaxEntries = o.NATEntries, o.NATEntriesV6
	m.NatNewV4.MaxEntries, m.NatNewV6.MaxEntries = unrepliedEntries(o.NATEntries), unrepliedEntries(o.NATEntriesV6)
	m.KeepV4.MaxEntries, m.KeepV6.MaxEntries = keepEntries(o.NATEntries), keepEntries(o.NATEntriesV6)
	m.FragV4.MaxEntries, m.FragV6.MaxEntries = o.FragEntries, o.FragEntries
	m.FragHeldV4.MaxEntries, m.FragHeldV6.MaxEntries = heldEntries(o.FragEntries), heldEntries(o.FragEntries)
	m.InboundV4.MaxEntries, m.InboundV6.MaxEntries = inboundEntries(o.NATEntries), inboundEntries(o.NATEntriesV6)
	return spec, nil
}

// testIngressInCB makes Load set bpf/parse.h's test_ingress_in_cb: this package's tests set it
// where BPF_PROG_TEST_RUN cannot set ingress_ifindex, and pass it in cb[0]. Nothing else does.
var testIngressInCB bool

// Load creates (or, with PinPath, reuses) the maps and loads both programs.
func Load(opts LoadOptions) (*Datapath, error) {
	if err := raiseMemlock(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	spec, err := opts.spec()
	if err != nil {
		return nil, err
	}
	if testIngressInCB {
		if err := spec.Variables[masqVarTestIngressInCb].Set(uint32(1)); err != nil {
			return nil, fmt.Errorf("set %s: %w", masqVarTestIngressInCb, err)
		}
	}
	var copts ebpf.CollectionOptions
	if opts.PinPath != "" {
		for name, m := range spec.Maps {
			if !ownMap(name) {
				m.Pinning = ebpf.PinByName
			}
		}
		copts.Maps.PinPath = opts.PinPath
		if err := makePinDir(opts.PinPath, spec); err != nil {
			return nil, err
		}
		if err := RemovePins(opts.PinPath, slices.Sorted(maps.Keys(scratchMaps))...); err != nil {
			return nil, err
		}
	}
	d := &Datapath{opts: opts}
	if err := spec.LoadAndAssign(&d.objs, &copts); err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("load bpf objects: %+v", verr)
		}
		return nil, fmt.Errorf("load bpf objects: %w", err)
	}
	if err := d.objs.Layout.Put(uint32(0), layoutRecord()); err != nil {
		d.objs.Close()
		return nil, fmt.Errorf("write the layout record: %w", err)
	}
	d.claim, d.claimErr = loadClaimer(d.objs.RuleStats, d.objs.RuleSlots)
	if err := d.recover(); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// smallIPv6Entries sizes the IPv6 NAT tables when the policy does not enable IPv6: the programs
// then record no IPv6 flow, and the tables are preallocated (the default size is ~33 MB).
const smallIPv6Entries = 1024

// OpenOptions say how large an opened datapath's maps are; zero values are LoadOptions'
// defaults.
type OpenOptions struct {
	// NATEntries and FragEntries are LoadOptions'; the IPv6 tables are as large only where
	// Policy enables IPv6, else small.
	NATEntries  uint32
	FragEntries uint32
	// MaxRules sizes the rule maps; zero keeps the pinned maps' size, or makes room for
	// Policy's rules where nothing is pinned (Grow makes more room later).
	MaxRules uint32
	// Policy is the policy the datapath is opened for.
	Policy *policy.Policy
	// ReplaceNewer takes over the pins of layouts newer than this build's (a rollback) rather
	// than refusing them: their maps, which this build cannot read, are removed once Finish
	// runs, and their flows are lost.
	ReplaceNewer bool
}

// Opened is a datapath Open loaded, and what Open found and did, for the caller to report.
type Opened struct {
	*Datapath
	// Migration is the migration of what older layouts (or maps set aside as resized) held,
	// its first pass done; nil when there was nothing to migrate. The caller swaps the programs,
	// then finishes it (Migration.Finish).
	Migration *Migration
	// Resized are the pinned maps of this layout that had other sizes, replaced by new ones;
	// Carried are those of them whose entries Migration carries (the flow state's), the others
	// start over (the policy's, written again by the next sync).
	Resized []PinMismatch
	Carried []string
	// Replaced are the pins of newer layouts that Migration removes, unread (ReplaceNewer).
	Replaced []Source
	// Loaded and Migrated are how long loading and the migration's first pass took.
	Loaded, Migrated time.Duration
}

// Open loads the datapath over what is pinned under root (<bpffs>/ip-masq-agent): the maps of
// this build's layout (LayoutDir) are reused, and the entries of older layouts' pins are
// migrated into them (the first pass: see Migrate). Pins of a layout this agent does not know
// are refused (an error wrapping ErrUnknownLayout) before anything is touched: they may be a
// newer agent's. Pinned maps of this layout but other sizes (the NAT tables after their size
// changed, the IPv6 ones after IPv6 was enabled) are replaced, and only they: the flow state's
// are set aside and migrated into the new ones, as an older layout's are (every flow keeps its
// mapping); the policy's are written again by the next sync, and the rule counters start over
// unless a policy that outgrew them carries them (Grow). The programs still attached keep using
// the old maps until the caller replaces them, so traffic never meets empty maps. With
// o.ReplaceNewer the pins of newer layouts are taken over instead of refused: nothing of them
// is carried, and Migration removes them.
func Open(root string, o OpenOptions) (*Opened, error) {
	pins, err := inspect(root)
	if err == nil && len(pins.Newer) > 0 && !o.ReplaceNewer {
		err = refuseNewer(pins.Newer[0])
	}
	if err != nil {
		return nil, err
	}
	lopts, err := o.loadOptions(pins)
	if err != nil {
		return nil, err
	}
	opened := &Opened{}
	if opened.Resized, err = CheckPins(lopts); err != nil {
		return nil, err
	}
	if aside, err := replaceResized(lopts.PinPath, opened); err != nil {
		return nil, err
	} else if aside {
		if pins, err = inspect(root); err != nil {
			return nil, err
		}
	}
	opened.Replaced = pins.Newer
	start := time.Now()
	if opened.Datapath, err = Load(lopts); err != nil {
		return nil, err
	}
	opened.Loaded = time.Since(start)
	if sources := append(pins.Sources, pins.Newer...); len(sources) == 0 {
		// A migration finished but for its mark.
		if err := os.Remove(swappedMark(lopts.PinPath)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			opened.Close()
			return nil, fmt.Errorf("remove the mark of a finished migration: %w", err)
		}
	} else {
		start = time.Now()
		if opened.Migration, err = opened.Migrate(sources); err != nil {
			opened.Close()
			return nil, err
		}
		opened.Migrated = time.Since(start)
	}
	return opened, nil
}

// loadOptions are the LoadOptions of o over pins: the rule maps as large as the largest pinned,
// else large enough for the policy.
func (o OpenOptions) loadOptions(pins Pins) (LoadOptions, error) {
	lopts := LoadOptions{PinPath: LayoutDir(pins.Root), MaxRules: o.MaxRules, NATEntries: o.NATEntries, FragEntries: o.FragEntries}
	if o.Policy == nil || !o.Policy.Enabled(policy.IPv6) {
		lopts.NATEntriesV6 = smallIPv6Entries
	}
	if lopts.MaxRules != 0 {
		return lopts, nil
	}
	dirs := []string{lopts.PinPath}
	for _, src := range pins.Sources {
		dirs = append(dirs, src.Dir)
	}
	for _, dir := range dirs {
		pinned, err := pinnedRuleCapacity(dir)
		if err != nil {
			return lopts, err
		}
		lopts.MaxRules = max(lopts.MaxRules, pinned)
	}
	if lopts.MaxRules == 0 && o.Policy != nil {
		lopts.MaxRules = CapacityFor(PolicyRules(o.Policy))
	}
	return lopts, nil
}

// The rule maps (the four tries, rule_stats and rule_slots) are sized by LoadOptions.MaxRules.
// A policy larger than they allow is served by loading maps with more room and adopting the old
// ones' slots and counters (AdoptRuleSlots); these helpers tell when and how large.

// The rule maps start with as many slots as ruleMapBudget of kernel memory holds on this
// machine (rule_stats has a copy per CPU), a power of two between minRules and maxStartRules:
// 32768 on 2 CPUs, 4096 from 16 CPUs on. A larger policy grows them, once, which costs a
// program reload (a few hundred milliseconds); a start size that holds the common configs
// avoids it. The tries allocate per entry and cost nothing until used.
const (
	ruleMapBudget = 2 << 20
	minRules      = 4096
	maxStartRules = 32768
)

// ErrOtherLayout is the error of OpenReadOnly for pins of another layout than this build's:
// an older layout's are migrated by the next agent, a newer one's belong to a newer agent.
var ErrOtherLayout = errors.New("pinned maps of another layout")

// OpenReadOnly opens the datapath pinned under root for a reader in another process (`dump`):
// its maps through read-only descriptors, no program loaded, nothing created or changed. It
// returns nil and no error when nothing is pinned there, and an error wrapping ErrOtherLayout
// (or ErrUnknownLayout) for the pins of another layout.
func OpenReadOnly(root string) (*Datapath, error) {
	entries, err := os.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) || err == nil && len(entries) == 0 {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read BPF pins: %w", err)
	}
	if err := CheckBPFFS(filepath.Dir(root)); err != nil {
		return nil, err
	}
	pins, err := Inspect(root)
	if err != nil {
		return nil, err
	}
	if !pins.Current && len(pins.Sources) > 0 {
		return nil, fmt.Errorf("%w: %s: the next agent migrates them to layout %d, which this build reads",
			ErrOtherLayout, pins.Sources[len(pins.Sources)-1], Layout)
	}
	return OpenPinnedReadOnly(LayoutDir(root))
}

// OpenPinned opens the maps a datapath pinned in dir (LoadOptions.PinPath), without loading
// programs and without creating anything. It fails with an error wrapping fs.ErrNotExist when a
// map is not pinned there. Egress and Ingress return nil on the result; everything that reads
// or writes maps works.
func OpenPinned(dir string) (*Datapath, error) { return openPinned(dir, nil) }

// OpenPinnedReadOnly is OpenPinned with read-only map descriptors: every reader works, every
// writer fails.
func OpenPinnedReadOnly(dir string) (*Datapath, error) {
	return openPinned(dir, &ebpf.LoadPinOptions{ReadOnly: true})
}

func openPinned(dir string, pinOpts *ebpf.LoadPinOptions) (*Datapath, error) {
	d := &Datapath{opts: LoadOptions{PinPath: dir}}
	for name, field := range d.mapFields() {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), pinOpts)
		if err != nil {
			d.objs.Close()
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		*field = m
	}
	d.opts.MaxRules = d.objs.RuleSlots.MaxEntries()
	d.opts.NATEntries = d.objs.NatV4.MaxEntries()
	d.opts.NATEntriesV6 = d.objs.NatV6.MaxEntries()
	d.opts.FragEntries = d.objs.FragV4.MaxEntries()
	if err := d.recover(); err != nil {
		d.objs.Close()
		return nil, err
	}
	return d, nil
}

// bpfFSMagic is the statfs magic of a BPF filesystem (BPF_FS_MAGIC).
const bpfFSMagic = 0xcafe4a11
