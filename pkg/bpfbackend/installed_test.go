package bpfbackend

import (
	"context"
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
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf/bpftest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// These tests load the datapath over a private bpffs and drive it with BPF_PROG_TEST_RUN; they
// attach nothing and send no packet. The one that lists devices runs inside a namespace of its
// own.

func compile(t *testing.T, doc string, ipv6 bool) *policy.Policy {
	t.Helper()
	cfg, err := config.Parse([]byte(doc), config.Options{EnableIPv6: ipv6})
	if err != nil {
		t.Fatal(err)
	}
	return policy.Compile(cfg, policy.Options{EnableIPv6: ipv6, RandomFully: true})
}

// loadPinned loads the datapath pinned under bpffs, as the backend does, with policy p.
func loadPinned(t *testing.T, bpffs string, p *policy.Policy) *bpf.Datapath {
	t.Helper()
	dp, err := bpf.Load(bpf.LoadOptions{PinPath: bpf.LayoutDir(filepath.Join(bpffs, PinDir)), NATEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	if err := dp.SyncPolicy(p); err != nil {
		t.Fatal(err)
	}
	return dp
}

func TestCheckBPFFS(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	if err := bpf.CheckBPFFS(bpffs); err != nil {
		t.Errorf("a bpffs: %v", err)
	}
	plain := t.TempDir()
	if err := bpf.CheckBPFFS(plain); err == nil || !strings.Contains(err.Error(), plain+" is not a BPF filesystem") {
		t.Errorf("a plain directory: %v", err)
	}
	if err := bpf.CheckBPFFS(filepath.Join(plain, "none")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a missing directory: %v", err)
	}
}

type row struct {
	fam    policy.Family
	rule   int
	prefix string
	origin policy.Origin
	entry  int
}

func rows(cs []datapath.RuleCounter) []row {
	out := make([]row, len(cs))
	for i, c := range cs {
		out[i] = row{c.Family, c.Rule, c.Prefix.String(), c.Origin, c.Entry}
	}
	return out
}

// TestReaderCounters: the reader maps installed rules to the configuration it is given; rules
// the configuration lacks follow their family's with rule 0, and without a configuration every
// rule is such a rule.
func TestReaderCounters(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	if r, err := Inspect(bpffs, nil, nil); r != nil || err != nil {
		t.Fatalf("nothing pinned: %v %v", r, err)
	}
	installed := compile(t, "masqueradeCIDRs: [{cidr: 10.10.0.0/16, address: 192.0.2.11}]\nnonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]\n", true)
	loadPinned(t, bpffs, installed)

	given := compile(t, "nonMasqueradeCIDRs: [192.168.0.0/16, 10.0.0.0/8]\n", false)
	r, err := Inspect(bpffs, nil, given)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got, err := r.Counters(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := []row{
		// given: link-local #1, 192.168/16 #2 (not installed: left out), 10/8 #3, outbound #4
		{policy.IPv4, 1, "169.254.0.0/16", policy.OriginLinkLocal, -1},
		{policy.IPv4, 3, "10.0.0.0/8", policy.OriginNonMasqueradeCIDRs, 1},
		{policy.IPv4, 4, "0.0.0.0/0", policy.OriginOutbound, -1},
		{policy.IPv4, 0, "10.10.0.0/16", policy.OriginMasqueradeCIDRs, -1},
		// IPv6 is not enabled in the given configuration: all of it is unknown to it.
		{policy.IPv6, 0, "fe80::/10", policy.OriginLinkLocal, -1},
		{policy.IPv6, 0, "fc00::/7", policy.OriginNonMasqueradeCIDRs, -1},
		{policy.IPv6, 0, "::/0", policy.OriginOutbound, -1},
	}
	if !slices.Equal(rows(got), want) {
		t.Errorf("counters:\n%v\nwant\n%v", rows(got), want)
	}
	info := r.Info()
	if info.Backend != Name || info.AttachMode != "tc" || !strings.Contains(info.Details, filepath.Join(bpffs, PinDir)) {
		t.Errorf("info %+v", info)
	}

	r2, err := Inspect(bpffs, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	got, err = r2.Counters(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 7 || slices.ContainsFunc(got, func(c datapath.RuleCounter) bool { return c.Rule != 0 || c.Origin == "" }) {
		t.Errorf("without a configuration: %v", rows(got))
	}
	// The masquerade address is read from the tries: the entry's own, and none elsewhere.
	for _, c := range got {
		want := netip.Addr{}
		if c.Origin == policy.OriginMasqueradeCIDRs {
			want = netip.MustParseAddr("192.0.2.11")
		}
		if c.Address != want {
			t.Errorf("%s %s reads masquerade address %v, want %v", c.Family, c.Prefix, c.Address, want)
		}
	}
}

// udp builds an Ethernet frame with a UDP datagram, addressed to the device test runs use
// (loopback, whose MAC is all zeros), as a frame for this host is.
func udp(t *testing.T, src, dst netip.AddrPort) []byte {
	t.Helper()
	eth := &layers.Ethernet{SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, DstMAC: make(net.HardwareAddr, 6), EthernetType: layers.EthernetTypeIPv4}
	ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolUDP, SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice()}
	u := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	if err := u.SetNetworkLayerForChecksum(ip); err != nil {
		t.Fatal(err)
	}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		eth, ip, u, gopacket.Payload("hello")); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// run runs a program on a frame, as a packet the node received on a pod's device (the head of
// struct __sk_buff, with ingress_ifindex set: the programs masquerade what the node forwards),
// and returns the (rewritten) frame.
func run(t *testing.T, prog *ebpf.Program, frame []byte) []byte {
	t.Helper()
	return runOn(t, prog, frame, 0)
}

// runOn is run on the device of ifindex (0: loopback), which must be in the thread's namespace.
func runOn(t *testing.T, prog *ebpf.Program, frame []byte, ifindex int) []byte {
	t.Helper()
	if !bpftest.RunSetsIngressIfindex() {
		// pkg/bpf's tests run the datapath on such kernels with ingress_ifindex in cb[0];
		// the backend's load the agent's, which reads the kernel's field only.
		testutil.NotOnThisKernel(t, "its BPF_PROG_TEST_RUN cannot set ingress_ifindex, which a forwarded packet has")
	}
	out := make([]byte, len(frame)+256)
	var skb [11]uint32 // len ... priority, ingress_ifindex, ifindex
	skb[9], skb[10] = 1000, uint32(ifindex)
	opts := ebpf.RunOptions{Data: frame, DataOut: out, Context: skb}
	ret, err := prog.Run(&opts)
	if err != nil {
		t.Fatal(err)
	}
	if ret != ^uint32(0) {
		t.Fatalf("verdict %d, want TC_ACT_UNSPEC (the chain goes on)", int32(ret))
	}
	return opts.DataOut
}

// TestNATReports: the NAT metrics and the dump summary of a datapath with two flows, one of them
// answered, read through Installed; sweep totals and drops come from their maps.
func TestNATReports(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	dp := loadPinned(t, bpffs, compile(t, "", false))
	// BPF_PROG_TEST_RUN runs on the loopback device: it is the uplink here.
	node := netip.MustParseAddr("192.0.2.1")
	if _, err := dp.SetUplink(1, bpf.Uplink{IPv4: node}); err != nil {
		t.Fatal(err)
	}
	remote := netip.MustParseAddrPort("198.51.100.7:53")
	out := run(t, dp.Egress(), udp(t, netip.MustParseAddrPort("10.1.0.5:1000"), remote))
	mapped := gopacket.NewPacket(out, layers.LayerTypeEthernet, gopacket.Default)
	sport := mapped.Layer(layers.LayerTypeUDP).(*layers.UDP).SrcPort
	run(t, dp.Ingress(), udp(t, remote, netip.AddrPortFrom(node, uint16(sport))))
	run(t, dp.Egress(), udp(t, netip.MustParseAddrPort("10.1.0.6:1000"), netip.MustParseAddrPort("198.51.100.8:123")))
	if err := dp.Maps()["sweep_stats"].Put(uint32(unix.IPPROTO_TCP), uint64(7)); err != nil {
		t.Fatal(err)
	}

	r, err := Inspect(bpffs, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	st, err := r.NATStats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	wantStates := []datapath.NATEntries{
		{Family: policy.IPv4, Protocol: "udp", State: "established", Entries: 2},
		{Family: policy.IPv4, Protocol: "udp", State: "unreplied", Entries: 2},
	}
	if !slices.Equal(st.Entries, wantStates) {
		t.Errorf("entries %+v, want %+v", st.Entries, wantStates)
	}
	// Both flows await a packet that confirms them: all four entries are in the unreplied table.
	for _, tb := range st.Tables {
		want := uint64(0)
		if tb.Family == policy.IPv4 && tb.Table == "unreplied" {
			want = 4
		}
		if tb.Entries != want || tb.Capacity == 0 {
			t.Errorf("table %+v, want %d entries and a capacity", tb, want)
		}
	}
	if len(st.Tables) != 6 {
		t.Errorf("tables %+v, want three per family", st.Tables)
	}
	if fmt.Sprint(st.Swept) != "map[icmp:0 icmpv6:0 tcp:7 udp:0]" {
		t.Errorf("swept %v", st.Swept)
	}
	if fmt.Sprint(st.Drops) != "map[no_addr:0 no_port:0 rewrite:0 untranslatable:0]" || st.PortAllocationFailures != 0 {
		t.Errorf("drops %v, failures %d", st.Drops, st.PortAllocationFailures)
	}
	// Every event is reported, zero or not: the two flows are two new mappings.
	if len(st.Events) != len(bpf.Events()) || st.Events["new_masq"] != 2 || st.Events["drop_no_port"] != 0 {
		t.Errorf("events %v, want all %d of them with new_masq 2", st.Events, len(bpf.Events()))
	}

	sum, err := r.NATSummary(context.Background(), 1)
	if err != nil {
		t.Fatal(err)
	}
	wantEntries := []datapath.NATEntries{
		{Family: policy.IPv4, Protocol: "udp", State: "established", Entries: 2},
		{Family: policy.IPv4, Protocol: "udp", State: "unreplied", Entries: 2},
	}
	if !slices.Equal(sum.Entries, wantEntries) {
		t.Errorf("summary %+v, want %+v", sum.Entries, wantEntries)
	}
	if len(sum.Busiest) != 1 || sum.Busiest[0].Endpoint != remote || sum.Busiest[0].Entries != 2 {
		t.Errorf("busiest %+v, want %s (the first of two with 2 entries each)", sum.Busiest, remote)
	}
}

// inNetns runs fn on the test goroutine's thread moved into a new namespace, and moves it back.
func inNetns(t *testing.T, fn func()) {
	t.Helper()
	testutil.InNetns(t, testutil.NewNetns(t), fn)
}

// TestCleanup: the pins go, twice is fine, and a directory that is not on a BPF filesystem is
// left alone.
func TestCleanup(t *testing.T) {
	bpffs := testutil.MountBPFFS(t)
	loadPinned(t, bpffs, compile(t, "", false))
	plain := t.TempDir()
	if err := os.Mkdir(filepath.Join(plain, PinDir), 0o700); err != nil {
		t.Fatal(err)
	}
	inNetns(t, func() {
		for i := range 2 {
			res, err := Cleanup(context.Background(), bpffs, nil)
			if err != nil {
				t.Fatalf("cleanup #%d: %v", i+1, err)
			}
			if (res.PinDir != "") != (i == 0) || len(res.Attachments) != 0 {
				t.Errorf("cleanup #%d: %+v", i+1, res)
			}
		}
		if _, err := os.Stat(filepath.Join(bpffs, PinDir)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pins left: %v", err)
		}
		if _, err := Cleanup(context.Background(), plain, nil); err == nil || !strings.Contains(err.Error(), "is not a BPF filesystem") {
			t.Errorf("cleanup of a plain directory: %v", err)
		}
		if _, err := os.Stat(filepath.Join(plain, PinDir)); err != nil {
			t.Errorf("a directory outside a bpffs was touched: %v", err)
		}
	})
}
