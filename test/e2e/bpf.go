package e2e

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// BPFBackend is the BPF datapath with its programs attached in mode (tc.ModeTCX or tc.ModeTC).
// Prepare mounts a BPF filesystem of the test's own (ip netns exec remounts /sys, and tests
// never use the host's /sys/fs/bpf) and gives it to the agent, dump and cleanup as --bpffs.
// Verify reads the pinned maps and the uplink's attachments back and compares them with the
// policy of the last good configuration.
func BPFBackend(mode string) Backend {
	return Backend{
		Name:     "bpf-" + mode,
		Flags:    []string{"--backend=bpf", "--attach-mode=" + mode},
		Tools:    []string{"iptables-nft-save", "iptables-legacy-save", "ip6tables-nft-save", "ip6tables-legacy-save"},
		Iptables: iptables.ModeNFT,
		Info:     datapath.Info{Backend: bpfbackend.Name, AttachMode: mode},
		NAT:      true,
		Prepare: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			env.AgentFlags = append(env.AgentFlags, "--bpffs="+MountBPFFS(t))
		},
		Verify: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			verifyBPF(ctx, t, env, mode)
		},
		Gone: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			if s := bpfLeft(t, env); s != "" {
				t.Errorf("BPF state left: %s", s)
			}
		},
		Drift: func(ctx context.Context, t testing.TB, env *Env) {
			t.Helper()
			driftBPF(t, env, mode)
		},
		DriftWhat: []string{datapath.DriftProgram, datapath.DriftTrie},
		Refusals: func(ctx context.Context, t testing.TB, env *Env) float64 {
			t.Helper()
			m, err := env.Agent.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			noPort, _ := bpf.EventDropNoPort.DropReason()
			drops, _ := m.Value("ip_masq_agent_drops_total", Labels{"reason": noPort})
			failures, _ := m.Value("ip_masq_agent_nat_port_allocation_failures_total", Labels{})
			if drops != failures {
				t.Errorf("no_port drops %v and port allocation failures %v differ", drops, failures)
			}
			return drops
		},
		FastExpiry: func(ctx context.Context, t testing.TB, env *Env) {
			env.AgentFlags = append(env.AgentFlags, "--nat-sweep-interval=200ms", "--nat-timeouts=tcp-closing=1s")
		},
		Damages: bpfDamages(mode),
	}
}

// MountBPFFS mounts a BPF filesystem in a temporary directory and unmounts it when the test ends
// (after the agent is gone: cleanups run in reverse order).
func MountBPFFS(t testing.TB) string {
	t.Helper()
	return testutil.MountBPFFS(t)
}

// BPFFS is the --bpffs the env's Prepare set, or "".
func (e *Env) BPFFS() string {
	for _, f := range e.AgentFlags {
		if v, ok := strings.CutPrefix(f, "--bpffs="); ok {
			return v
		}
	}
	return ""
}

// UplinkIndex is the ifindex of the node's uplink.
func (e *Env) UplinkIndex(t testing.TB) int {
	t.Helper()
	var idx int
	if err := testutil.Do(e.Node, func() error {
		ifc, err := net.InterfaceByName(Uplink)
		if err == nil {
			idx = ifc.Index
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return idx
}

// UplinkMAC is the MAC address of the node's uplink.
func (e *Env) UplinkMAC(t testing.TB) bpf.MAC {
	t.Helper()
	var mac bpf.MAC
	if err := testutil.Do(e.Node, func() error {
		ifc, err := net.InterfaceByName(Uplink)
		if err == nil {
			mac = bpf.MACOf(ifc.HardwareAddr)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return mac
}

// nomasqV4 is the name of the IPv4 non-masquerade trie's pin.
var _, nomasqV4 = bpf.TrieMaps(policy.IPv4)

// PinRoot is the agent's pin directory, and PinDir where it pins the maps of its layout.
func (e *Env) PinRoot() string { return filepath.Join(e.BPFFS(), bpfbackend.PinDir) }
func (e *Env) PinDir() string  { return bpf.LayoutDir(e.PinRoot()) }

// GoodPolicy compiles the last good configuration with the env's policy flags.
func (e *Env) GoodPolicy(t testing.TB) *policy.Policy {
	t.Helper()
	copts := config.Options{EnableIPv6: e.FlagSet("enable-ipv6"), NoMasqAllReservedRanges: e.FlagSet("nomasq-all-reserved-ranges")}
	cfg, err := config.Load(e.GoodConfig(t), copts)
	if err != nil {
		t.Fatalf("the last good configuration does not parse: %v", err)
	}
	ports, err := policy.ParsePortRanges(e.FlagValue("to-ports", ""))
	if err != nil {
		t.Fatal(err)
	}
	return policy.Compile(cfg, policy.Options{EnableIPv6: copts.EnableIPv6,
		RandomFully: e.FlagValue("random-fully", "true") == "true", ToPorts: ports})
}

// Attached is a program on a device hook, as the kernel reports it.
type Attached struct {
	Mode, Dir, Name string
}

// UplinkPrograms lists the programs attached to the node's uplink, by tcx and by tc filters,
// and whether the uplink has a clsact qdisc.
func (e *Env) UplinkPrograms(t testing.TB) ([]Attached, bool) {
	t.Helper()
	return e.DevicePrograms(t, Uplink)
}

// DevicePrograms is UplinkPrograms for any device of the node.
func (e *Env) DevicePrograms(t testing.TB, dev string) ([]Attached, bool) {
	t.Helper()
	var out []Attached
	clsact := false
	err := testutil.Do(e.Node, func() error {
		ifc, err := net.InterfaceByName(dev)
		if err != nil {
			return err
		}
		for _, d := range []struct {
			name string
			typ  ebpf.AttachType
			tc   uint32
		}{{"egress", ebpf.AttachTCXEgress, netlink.HANDLE_MIN_EGRESS}, {"ingress", ebpf.AttachTCXIngress, netlink.HANDLE_MIN_INGRESS}} {
			// A kernel without tcx (before 6.6) answers EINVAL: it has no such attach type.
			res, err := link.QueryPrograms(link.QueryOptions{Target: ifc.Index, Attach: d.typ})
			if err != nil && !errors.Is(err, ebpf.ErrNotSupported) && !errors.Is(err, unix.EINVAL) {
				return fmt.Errorf("query tcx %s: %w", d.name, err)
			}
			if res != nil {
				for _, p := range res.Programs {
					out = append(out, Attached{tc.ModeTCX, d.name, programName(p.ID)})
				}
			}
			l, err := netlink.LinkByIndex(ifc.Index)
			if err != nil {
				return err
			}
			fs, err := netlink.FilterList(l, d.tc)
			if err != nil && !errors.Is(err, unix.EINVAL) {
				return fmt.Errorf("list tc filters %s: %w", d.name, err)
			}
			for _, f := range fs {
				name := f.Type()
				if bf, ok := f.(*netlink.BpfFilter); ok {
					name = programName(ebpf.ProgramID(bf.Id))
				}
				out = append(out, Attached{tc.ModeTC, d.name, name})
			}
			qs, err := netlink.QdiscList(l)
			if err != nil {
				return err
			}
			clsact = clsact || slices.ContainsFunc(qs, func(q netlink.Qdisc) bool { return q.Type() == "clsact" })
		}
		return nil
	})
	if err != nil {
		t.Fatalf("read the programs of %s: %v", dev, err)
	}
	return out, clsact
}

func programName(id ebpf.ProgramID) string {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return fmt.Sprintf("program %d (%v)", id, err)
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return fmt.Sprintf("program %d (%v)", id, err)
	}
	return info.Name
}

// TriePrefixes reads the prefixes of a pinned LPM trie, straight from its bytes (prefixlen, then
// the address in network order), independently of the engine's decoding.
func TriePrefixes(t testing.TB, path string) []netip.Prefix {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	defer m.Close()
	var out []netip.Prefix
	var k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		addr, ok := netip.AddrFromSlice(k[4:])
		if !ok {
			t.Fatalf("%s: key %x", path, k)
		}
		out = append(out, netip.PrefixFrom(addr, int(binary.NativeEndian.Uint32(k[:4]))))
	}
	if err := it.Err(); err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// verifyBPF checks the installed BPF datapath against the policy of the env's last good
// configuration: the tries hold exactly its prefixes, every rule has its counter slot, the
// uplink has its SNAT addresses and exactly our two programs in mode, and no iptables chain of
// the agent is left in either mode.
func verifyBPF(ctx context.Context, t testing.TB, env *Env, mode string) {
	t.Helper()
	p := env.GoodPolicy(t)
	want := map[string][]netip.Prefix{}
	type ruleKey struct {
		set    string
		fam    policy.Family
		prefix netip.Prefix
		action policy.Action
		origin policy.Origin
	}
	wantRules := map[ruleKey]bool{}
	for _, fam := range policy.Families() {
		masq, nomasq := bpf.TrieMaps(fam)
		want[masq], want[nomasq] = []netip.Prefix{}, []netip.Prefix{}
		if !p.Enabled(fam) {
			continue
		}
		for _, s := range p.Sources {
			for _, r := range s.Policy.Rules(fam) {
				wantRules[ruleKey{s.Name, fam, r.Prefix, r.Action, r.Origin}] = true
			}
		}
		var sources []netip.Prefix
		for _, e := range p.SourceTable(fam) {
			sources = append(sources, e.Prefix)
		}
		want[bpf.SourceTrie(fam)] = sources
		rules := p.Rules(fam)
		for i, r := range rules {
			wantRules[ruleKey{"", fam, r.Prefix, r.Action, r.Origin}] = true
			if r.Origin == policy.OriginOutbound && i == len(rules)-1 {
				continue // the fallback lives in nat_config
			}
			name := nomasq
			if r.Action == policy.Masquerade {
				name = masq
			}
			if !slices.Contains(want[name], r.Prefix) {
				want[name] = append(want[name], r.Prefix)
			}
		}
	}
	for name, prefixes := range want {
		slices.SortFunc(prefixes, func(a, b netip.Prefix) int { return strings.Compare(a.String(), b.String()) })
		got := TriePrefixes(t, filepath.Join(env.PinDir(), name))
		if !slices.Equal(got, prefixes) {
			t.Errorf("%s holds %v, want %v", name, got, prefixes)
		}
	}

	r, err := bpf.OpenPinnedReadOnly(env.PinDir())
	if err != nil {
		t.Fatalf("open the pins: %v", err)
	}
	defer r.Close()
	rules, err := r.InstalledRules()
	if err != nil {
		t.Fatal(err)
	}
	got := map[ruleKey]bool{}
	for _, ir := range rules {
		got[ruleKey{ir.Set, ir.Family, ir.Prefix, ir.Action, ir.Origin}] = true
	}
	for k := range wantRules {
		if !got[k] {
			t.Errorf("rule %v has no counter slot", k)
		}
	}
	for k := range got {
		if !wantRules[k] {
			t.Errorf("a counter slot is left for %v, which the policy does not have", k)
		}
	}

	u, ok, err := r.Uplink(env.UplinkIndex(t))
	wantUplink := bpf.Uplink{IPv4: cmp.Or(p.MasqueradeAddress, NodeAddr4), MAC: env.UplinkMAC(t)}
	if p.Enabled(policy.IPv6) {
		wantUplink.IPv6 = cmp.Or(p.MasqueradeAddressIPv6, NodeAddr6)
	}
	if err != nil || !ok || u != wantUplink {
		t.Errorf("uplink_snat of %s: %+v %v %v, want %+v", Uplink, u, ok, err, wantUplink)
	}

	progs, _ := env.UplinkPrograms(t)
	wantProgs := ourPrograms(mode)
	if !slices.Equal(progs, wantProgs) {
		t.Errorf("programs on %s: %v, want %v", Uplink, progs, wantProgs)
	}

	// Exclusive: nothing of the iptables backend.
	for _, m := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		for _, fam := range policy.Families() {
			if s := installed(ctx, t, env, m, fam); s != "" {
				t.Errorf("the BPF backend runs, but iptables-%s %s holds:\n%s", m, fam, s)
			}
		}
	}
}

// bpfLeft describes what of the BPF backend is left in the node: programs or filters on the
// uplink, a clsact qdisc, pins. Empty when nothing is.
func bpfLeft(t testing.TB, env *Env) string {
	t.Helper()
	var left []string
	progs, clsact := env.UplinkPrograms(t)
	others := false // programs of other components (neighbours) stay, and their clsact qdisc
	for _, p := range progs {
		if !ourProgram(p.Name) {
			others = others || p.Mode == tc.ModeTC
			continue
		}
		left = append(left, fmt.Sprintf("%s %s program %s on %s", p.Mode, p.Dir, p.Name, Uplink))
	}
	if clsact && !others {
		left = append(left, "a clsact qdisc on "+Uplink)
	}
	if env.BPFFS() != "" {
		entries, err := os.ReadDir(env.PinRoot())
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
		for _, e := range entries {
			left = append(left, "pin "+e.Name())
		}
	}
	return strings.Join(left, "; ")
}

// ourProgram tells the agent's programs by name (bpf/masq.c's entry points).
func ourProgram(name string) bool { return name == "tc_egress" || name == "tc_ingress" }

// ourPrograms are the agent's programs on a device it attached them to in mode, as
// DevicePrograms lists them.
func ourPrograms(mode string) []Attached {
	return []Attached{{mode, "egress", "tc_egress"}, {mode, "ingress", "tc_ingress"}}
}

// driftBPF damages the datapath as an admin might: the egress program is detached from the
// uplink, and 10.0.0.0/8 is deleted from the non-masquerade trie.
func driftBPF(t testing.TB, env *Env, mode string) {
	t.Helper()
	if err := detachEgress(env, mode); err != nil {
		t.Fatalf("drift: %v", err)
	}
	if err := deleteTrieEntry(env, nomasqV4, netip.MustParsePrefix("10.0.0.0/8")); err != nil {
		t.Fatalf("drift: %v", err)
	}
}

// detachEgress removes the uplink's egress program: its tc filters, or its tcx links.
func detachEgress(env *Env, mode string) error {
	return testutil.Do(env.Node, func() error {
		ifc, err := net.InterfaceByName(Uplink)
		if err != nil {
			return err
		}
		if mode == tc.ModeTC {
			l, err := netlink.LinkByIndex(ifc.Index)
			if err != nil {
				return err
			}
			fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_EGRESS)
			if err != nil {
				return err
			}
			for _, f := range fs {
				if err := netlink.FilterDel(f); err != nil {
					return fmt.Errorf("delete tc filter: %w", err)
				}
			}
			return nil
		}
		res, err := link.QueryPrograms(link.QueryOptions{Target: ifc.Index, Attach: ebpf.AttachTCXEgress})
		if err != nil {
			return err
		}
		for _, p := range res.Programs {
			id, ok := p.LinkID()
			if !ok {
				continue
			}
			l, err := link.NewFromID(id)
			if err != nil {
				return err
			}
			err = l.Detach()
			l.Close()
			if err != nil {
				return fmt.Errorf("detach tcx link %d: %w", id, err)
			}
		}
		return nil
	})
}

// trieKey is a pinned LPM trie's key: prefix length, then the address in network order.
func trieKey(p netip.Prefix) []byte {
	key := make([]byte, 4+p.Addr().BitLen()/8)
	binary.NativeEndian.PutUint32(key, uint32(p.Bits()))
	copy(key[4:], p.Addr().AsSlice())
	return key
}

// deleteTrieEntry deletes a prefix from a pinned trie.
func deleteTrieEntry(env *Env, trie string, p netip.Prefix) error {
	m, err := ebpf.LoadPinnedMap(filepath.Join(env.PinDir(), trie), nil)
	if err != nil {
		return err
	}
	defer m.Close()
	if err := m.Delete(trieKey(p)); err != nil {
		return fmt.Errorf("delete %s from %s: %w", p, trie, err)
	}
	return nil
}

// pinnedID is the id of the map or link pinned at path, or 0 when nothing is.
func pinnedID(t testing.TB, path string, isLink bool) uint32 {
	t.Helper()
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return 0
	}
	if isLink {
		l, err := link.LoadPinnedLink(path, nil)
		if err != nil {
			t.Fatalf("open %s: %v", path, err)
		}
		defer l.Close()
		info, err := l.Info()
		if err != nil {
			t.Fatal(err)
		}
		return uint32(info.ID)
	}
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	defer m.Close()
	info, err := m.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return uint32(id)
}

// bpfDamages change the BPF datapath the ways its drift check must notice: a program detached,
// a trie entry deleted, a map pin and a tcx link pin removed, an uplink's SNAT address deleted.
// A pin must come back pinning the very object it pinned before (the maps keep their flows).
func bpfDamages(mode string) []Damage {
	programs := func(ctx context.Context, t testing.TB, env *Env) bool {
		t.Helper()
		got, _ := env.UplinkPrograms(t)
		return slices.Equal(got, ourPrograms(mode))
	}
	tenSlash8 := netip.MustParsePrefix("10.0.0.0/8")
	var natID, linkID uint32 // the pinned objects before their pins were removed
	natPin := func(env *Env) string { return filepath.Join(env.PinDir(), bpf.MapNATv4) }
	linkPin := func(t testing.TB, env *Env) string {
		return filepath.Join(env.PinRoot(), bpfbackend.LinkDir, fmt.Sprintf("%d-ingress", env.UplinkIndex(t)))
	}
	ds := []Damage{
		{Name: "program detached", What: []string{datapath.DriftProgram}, Repaired: programs,
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				if err := detachEgress(env, mode); err != nil {
					t.Fatalf("damage: %v", err)
				}
			}},
		{Name: "trie entry deleted", What: []string{datapath.DriftTrie},
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				if err := deleteTrieEntry(env, nomasqV4, tenSlash8); err != nil {
					t.Fatalf("damage: %v", err)
				}
			},
			Repaired: func(ctx context.Context, t testing.TB, env *Env) bool {
				return slices.Contains(TriePrefixes(t, filepath.Join(env.PinDir(), nomasqV4)), tenSlash8)
			}},
		{Name: "map pin removed", What: []string{datapath.DriftPin},
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				natID = pinnedID(t, natPin(env), false)
				if err := os.Remove(natPin(env)); err != nil {
					t.Fatalf("damage: %v", err)
				}
			},
			Repaired: func(ctx context.Context, t testing.TB, env *Env) bool {
				id := pinnedID(t, natPin(env), false)
				if id != 0 && id != natID {
					t.Fatalf("nat_v4 pinned again as map %d, was map %d: a new, empty table", id, natID)
				}
				return id == natID
			}},
		{Name: "uplink address deleted", What: []string{datapath.DriftUplinkAddr},
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				m, err := ebpf.LoadPinnedMap(filepath.Join(env.PinDir(), bpf.MapUplinkSNAT), nil)
				if err != nil {
					t.Fatalf("damage: %v", err)
				}
				defer m.Close()
				if err := m.Delete(uint32(env.UplinkIndex(t))); err != nil {
					t.Fatalf("damage: %v", err)
				}
			},
			Repaired: func(ctx context.Context, t testing.TB, env *Env) bool {
				t.Helper()
				r, err := bpf.OpenPinnedReadOnly(env.PinDir())
				if err != nil {
					t.Fatal(err)
				}
				defer r.Close()
				u, ok, err := r.Uplink(env.UplinkIndex(t))
				if err != nil {
					t.Fatal(err)
				}
				return ok && u.IPv4 == NodeAddr4
			}},
	}
	if mode == tc.ModeTCX {
		ds = append(ds, Damage{Name: "link pin removed", What: []string{datapath.DriftPin},
			Do: func(ctx context.Context, t testing.TB, env *Env) {
				linkID = pinnedID(t, linkPin(t, env), true)
				if err := os.Remove(linkPin(t, env)); err != nil {
					t.Fatalf("damage: %v", err)
				}
			},
			Repaired: func(ctx context.Context, t testing.TB, env *Env) bool {
				id := pinnedID(t, linkPin(t, env), true)
				if id != 0 && id != linkID {
					t.Fatalf("the ingress link pinned again as link %d, was link %d", id, linkID)
				}
				return id == linkID && programs(ctx, t, env)
			}})
	}
	return ds
}
