package bpfbackend

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf/bpftest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
)

const sourceRulesDoc = `nonMasqueradeCIDRs: [10.0.0.0/8]
sourceRules:
- name: partner
  cidrs: [10.244.1.0/24]
  nonMasqueradeCIDRs: [10.0.0.0/8, 203.0.113.0/24]
- name: quiet
  cidrs: [10.244.0.0/16]
  masqOutBound: false
`

type setRow struct {
	set    string
	rule   int
	prefix string
}

func setRows(cs []datapath.RuleCounter) []setRow {
	out := make([]setRow, len(cs))
	for i, c := range cs {
		out[i] = setRow{c.Set, c.Rule, c.Prefix.String()}
	}
	return out
}

// TestSourceRuleCounters: the counters of the source rules' lists follow the global ones', each
// with its rule's name in Set and its place in that rule's list; an apply that removes a rule
// and adds another reports theirs, and a reader in another process finds the rules' names in
// the maps; cleanup removes the source rules' maps with the rest.
func TestSourceRuleCounters(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	inNetns(t, func() {
		link := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "uplink0"}, PeerName: "peer0"}
		if err := netlink.LinkAdd(link); err != nil {
			t.Fatal(err)
		}
		addr, _ := netlink.ParseAddr("192.0.2.1/24")
		if err := netlink.AddrAdd(link, addr); err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(link); err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		b, err := New(ctx, Options{BPFFS: bpffs, Interfaces: []string{"uplink0"}})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		counters := func(want []setRow) {
			t.Helper()
			got, err := b.Counters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(setRows(got), want) {
				t.Errorf("counters:\n%v\nwant\n%v", setRows(got), want)
			}
		}
		if err := b.Apply(ctx, compile(t, sourceRulesDoc, false)); err != nil {
			t.Fatal(err)
		}
		counters([]setRow{
			{"", 1, "169.254.0.0/16"}, {"", 2, "10.0.0.0/8"}, {"", 3, "0.0.0.0/0"},
			{"partner", 1, "169.254.0.0/16"}, {"partner", 2, "10.0.0.0/8"}, {"partner", 3, "203.0.113.0/24"}, {"partner", 4, "0.0.0.0/0"},
			{"quiet", 1, "169.254.0.0/16"}, {"quiet", 2, "10.0.0.0/8"},
		})
		// A pod of partner toward 203.0.113.0/24 counts there, and keeps its address (where
		// BPF_PROG_TEST_RUN can send a forwarded packet: see runOn).
		sent := uint64(0)
		if bpftest.RunSetsIngressIfindex() {
			pod, dst := netip.MustParseAddrPort("10.244.1.5:1000"), netip.MustParseAddrPort("203.0.113.9:53")
			frame := udp(t, pod, dst)
			if out := run(t, b.dp.Load().Egress(), frame); !bytes.Equal(out, frame) {
				t.Errorf("partner's pod toward %s was rewritten", dst)
			}
			sent = 1
		}
		if c := counterOf(t, b, "203.0.113.0/24"); c.Set != "partner" || c.Packets != sent {
			t.Errorf("203.0.113.0/24: %+v, want partner's with %d packets", c, sent)
		}

		// quiet goes, batch comes (before partner), partner stays with its counters.
		if err := b.Apply(ctx, compile(t, `nonMasqueradeCIDRs: [10.0.0.0/8]
sourceRules:
- name: batch
  cidrs: [10.244.2.0/24]
  masqueradeCIDRs: [198.51.100.0/24]
- name: partner
  cidrs: [10.244.1.0/24]
  nonMasqueradeCIDRs: [10.0.0.0/8, 203.0.113.0/24]
`, false)); err != nil {
			t.Fatal(err)
		}
		counters([]setRow{
			{"", 1, "169.254.0.0/16"}, {"", 2, "10.0.0.0/8"}, {"", 3, "0.0.0.0/0"},
			{"batch", 1, "198.51.100.0/24"}, {"batch", 2, "169.254.0.0/16"}, {"batch", 3, "10.0.0.0/8"}, {"batch", 4, "0.0.0.0/0"},
			{"partner", 1, "169.254.0.0/16"}, {"partner", 2, "10.0.0.0/8"}, {"partner", 3, "203.0.113.0/24"}, {"partner", 4, "0.0.0.0/0"},
		})
		if c := counterOf(t, b, "203.0.113.0/24"); c.Set != "partner" || c.Packets != sent {
			t.Errorf("203.0.113.0/24 after the apply: %+v, want partner's with %d packets", c, sent)
		}
		r, err := Inspect(bpffs, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		got, err := r.Counters(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sets := map[string]int{}
		for _, c := range got {
			sets[c.Set]++
		}
		if sets[""] != 3 || sets["batch"] != 4 || sets["partner"] != 4 || len(sets) != 3 {
			t.Errorf("a reader without the configuration finds the counters of %v", sets)
		}

		srcCfg := filepath.Join(bpf.LayoutDir(filepath.Join(bpffs, PinDir)), "src_cfg")
		if _, err := os.Stat(srcCfg); err != nil {
			t.Fatalf("src_cfg not pinned: %v", err)
		}
		if _, err := Cleanup(ctx, bpffs, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(bpffs, PinDir)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pins left after cleanup: %v", err)
		}
	})
}
