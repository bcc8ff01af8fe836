package cli

import (
	"bytes"
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// nftNode is a node with only iptables-nft whose IPv4 nat table holds p's chain, line i with
// i*10 packets and i*600 bytes, plus extra lines. It never runs a tool: these tests run in the
// host's namespace.
func nftNode(p *policy.Policy, extra ...string) *iptablestest.Fake {
	f := iptablestest.New()
	f.Uninstall("-legacy")
	for _, plain := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		delete(f.Installed, plain)
	}
	if p == nil {
		f.NAT(iptables.ModeNFT, policy.IPv4)
		return f
	}
	nat := f.NAT(iptables.ModeNFT, policy.IPv4)
	nat.Chains = append(nat.Chains, iptables.DefaultChain)
	nat.Rules["POSTROUTING"] = []iptablestest.Rule{{Text: iptables.JumpRule(iptables.DefaultChain).String()}}
	for i, l := range iptables.ChainLines(p, policy.IPv4, iptables.DefaultChain) {
		nat.Rules[iptables.DefaultChain] = append(nat.Rules[iptables.DefaultChain],
			iptablestest.Rule{Text: l.Rule.String(), Packets: uint64(i+1) * 10, Bytes: uint64(i+1) * 600})
	}
	for _, e := range extra {
		nat.Rules[iptables.DefaultChain] = append(nat.Rules[iptables.DefaultChain], iptablestest.Rule{Text: e, Packets: 1, Bytes: 60})
	}
	return f
}

// onlyRead fails the test unless every tool dump ran only read: --version and iptables-save -c.
func onlyRead(t *testing.T, f *iptablestest.Fake) {
	t.Helper()
	for _, c := range f.Calls {
		if !slices.Contains(c.Args, "--version") && (!strings.HasSuffix(c.Name, "-save") || !slices.Equal(c.Args, []string{"-c"})) {
			t.Errorf("dump ran %s %q", c.Name, c.Args)
		}
	}
}

func dumpFlags(t *testing.T, args ...string) *agentFlags {
	t.Helper()
	var af agentFlags
	fs := newFlagSet(commandNamed("dump"), &bytes.Buffer{})
	af.register(fs)
	if _, err := parseInterspersed(fs.FlagSet, args); err != nil {
		t.Fatal(err)
	}
	return &af
}

// runDumpWith runs dump on a node whose iptables tools r runs.
func runDumpWith(t *testing.T, r iptables.Runner, args ...string) (string, string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	af := dumpFlags(t, args...)
	af.own[iptables.Name].(*iptables.Settings).Runner = r
	err := dump(testContext(t), af, defaultTop, false, &out, &errOut)
	return out.String(), errOut.String(), err
}

func fields(out string) [][]string {
	var rows [][]string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		rows = append(rows, strings.Fields(l))
	}
	return rows
}

func TestDumpIptables(t *testing.T) {
	const doc = "masqueradeCIDRs: [10.10.10.10/32]\nnonMasqueradeCIDRs: [10.0.0.0/8]\n"
	path := writeConfig(t, doc)
	cfg, err := config.Parse([]byte(doc), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// The agent runs with --random-fully (the default) and the kernel took it.
	p := policy.Compile(cfg, policy.Options{RandomFully: true})
	stray := "-A IP-MASQ-AGENT -d 192.0.2.0/24 -j MASQUERADE"
	r := nftNode(p, stray)
	defer onlyRead(t, r)
	bpffs := t.TempDir()

	out, stderr, err := runDumpWith(t, r, "--config="+path, "--bpffs="+bpffs)
	if err != nil {
		t.Fatalf("dump: %v\n%s", err, stderr)
	}
	want := [][]string{
		{"iptables:", "iptables-nft,", "chain", "IP-MASQ-AGENT", "(ipv4)"},
		{"FAMILY", "RULE", "ACTION", "CIDR", "ORIGIN", "PACKETS", "BYTES"},
		{"ipv4", "1", "MASQUERADE", "10.10.10.10/32", "masqueradeCIDRs[0]", "10", "600"},
		{"ipv4", "2", "RETURN", "169.254.0.0/16", "link-local", "20", "1200"},
		{"ipv4", "3", "RETURN", "10.0.0.0/8", "nonMasqueradeCIDRs[0]", "30", "1800"},
		{"ipv4", "4", "MASQUERADE", "0.0.0.0/0", "outbound", "40", "2400"},
		{"ipv4", "-", "MASQUERADE", "192.0.2.0/24", "?", "1", "60"},
	}
	rows := fields(out)
	if len(rows) < len(want)+2 {
		t.Fatalf("dump printed:\n%s", out)
	}
	for i, w := range want {
		if !slices.Equal(rows[i], w) {
			t.Errorf("row %d: %q, want %q", i, rows[i], w)
		}
	}
	if !strings.Contains(out, "rule -: installed, but not a rule of the configuration") || !strings.Contains(out, "iptables counts connections") {
		t.Errorf("notes missing:\n%s", out)
	}

	// A configuration that cannot be read: the counters still show, without origins.
	bad := writeConfig(t, "nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	out, stderr, err = runDumpWith(t, r, "--config="+bad, "--bpffs="+bpffs)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stderr, "host bits are set") || !strings.Contains(stderr, "without their origin") {
		t.Errorf("stderr %q", stderr)
	}
	if got := fields(out)[2]; !slices.Equal(got, []string{"ipv4", "-", "MASQUERADE", "10.10.10.10/32", "?", "10", "600"}) {
		t.Errorf("first row without a configuration: %q", got)
	}

	// Pins present, but not on a BPF filesystem: an error, after the iptables table.
	if err := os.MkdirAll(filepath.Join(bpffs, bpfbackend.PinDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bpffs, bpfbackend.PinDir, "rule_stats"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	out, _, err = runDumpWith(t, r, "--config="+path, "--bpffs="+bpffs)
	if err == nil || !strings.Contains(err.Error(), "read the BPF datapath pinned under "+filepath.Join(bpffs, bpfbackend.PinDir)) ||
		!strings.Contains(err.Error(), "is not a BPF filesystem") {
		t.Errorf("err = %v, want one about the BPF pins", err)
	}
	if !strings.Contains(out, "10.10.10.10/32") {
		t.Errorf("the iptables table is not shown next to the error:\n%s", out)
	}
}

func TestDumpNothingInstalled(t *testing.T) {
	r := nftNode(nil)
	defer onlyRead(t, r)
	bpffs := t.TempDir()
	// An empty pin directory holds nothing.
	if err := os.Mkdir(filepath.Join(bpffs, bpfbackend.PinDir), 0o755); err != nil {
		t.Fatal(err)
	}
	_, _, err := runDumpWith(t, r, "--config="+filepath.Join(t.TempDir(), "none"), "--bpffs="+bpffs, "--masq-chain=MY-CHAIN")
	if err == nil || !strings.Contains(err.Error(), "no datapath installed: ") || ExitCode(err) != 1 ||
		!strings.Contains(err.Error(), "no MY-CHAIN chain in iptables-nft or iptables-legacy") ||
		!strings.Contains(err.Error(), "nothing pinned under "+filepath.Join(bpffs, bpfbackend.PinDir)) {
		t.Errorf("err = %v", err)
	}
}

func TestDumpCommandLine(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		wantErr string
	}{
		{[]string{"dump", "extra"}, "dump takes no arguments"},
		{[]string{"dump", "--masq-chain=bad name"}, "only letters, digits"},
		{[]string{"dump", "--to-ports=9-1"}, "starts after it ends"},
	} {
		_, _, err := run(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) || ExitCode(err) != 2 {
			t.Errorf("%q: err %v (exit %d), want %q (exit 2)", tc.args, err, ExitCode(err), tc.wantErr)
		}
	}
	// It takes the agent's flags, so that the DaemonSet's arguments can be reused, and lists
	// those it reads: the configuration's, the datapath's, and its own.
	help := helpOf(t, "dump")
	for _, flag := range []string{"-config", "-masq-chain", "-bpffs", "-enable-ipv6", "-interfaces", "-top", "-from-file"} {
		if !strings.Contains(help, "\n  "+flag+" ") && !strings.Contains(help, "\n  "+flag+"\n") {
			t.Errorf("dump --help does not list %s:\n%s", flag, help)
		}
	}
	for _, flag := range []string{"--metrics-address", "--config-source", "--backend"} {
		if strings.Contains(help, "\n  -"+flag[2:]) || !strings.Contains(help, flag) {
			t.Errorf("dump --help lists %s, which it does not read, or does not name it as accepted:\n%s", flag, help)
		}
	}
}

// natReader is a datapath with a NAT table, as the BPF backend's reader will be.
var natReader = &datapathtest.NATBackend{
	Installed: datapath.Info{Backend: "bpf", AttachMode: "tcx", Details: "uplink eth0"},
	Backend: datapathtest.Backend{RuleCounters: []datapath.RuleCounter{{Family: policy.IPv6, Rule: 1,
		Prefix: netip.MustParsePrefix("2001:db8:5::/48"), Action: policy.Masquerade, Origin: policy.OriginMasqueradeCIDRs,
		Address: netip.MustParseAddr("2001:db8::11"), Packets: 7, Bytes: 560}, {Family: policy.IPv6, Rule: 2,
		Prefix: netip.MustParsePrefix("::/0"), Action: policy.Masquerade, Origin: policy.OriginOutbound, Entry: -1,
		Packets: 123, Bytes: 45678}}},
	Summary: datapath.NATSummary{
		Entries: []datapath.NATEntries{
			{Family: policy.IPv4, Protocol: "udp", State: "unreplied", Entries: 4},
			{Family: policy.IPv6, Protocol: "tcp", State: "established", Entries: 8},
		},
		Busiest: []datapath.RemoteEndpoint{
			{Protocol: "tcp", Endpoint: netip.MustParseAddrPort("[2001:db8::1]:443"), Entries: 8},
			{Protocol: "udp", Endpoint: netip.MustParseAddrPort("192.0.2.53:53"), Entries: 4},
		},
	},
}

func TestDumpNATTable(t *testing.T) {
	var out bytes.Buffer
	if err := writeReader(context.Background(), &out, natReader, 1); err != nil {
		t.Fatal(err)
	}
	want := [][]string{
		{"bpf", "(tcx):", "uplink", "eth0"},
		{"FAMILY", "RULE", "ACTION", "CIDR", "ORIGIN", "PACKETS", "BYTES"},
		{"ipv6", "1", "MASQUERADE", "2001:db8:5::/48", "masqueradeCIDRs[0]", "7", "560", "to:2001:db8::11"},
		{"ipv6", "2", "MASQUERADE", "::/0", "outbound", "123", "45678"},
		{"NAT", "table"},
		{"FAMILY", "PROTOCOL", "STATE", "ENTRIES"},
		{"ipv4", "udp", "unreplied", "4"},
		{"ipv6", "tcp", "established", "8"},
		{"total", "12"},
		{"busiest", "remote", "endpoints"},
		{"PROTOCOL", "ENDPOINT", "ENTRIES"},
		{"tcp", "[2001:db8::1]:443", "8"},
	}
	var rows [][]string
	for _, r := range fields(out.String()) {
		if len(r) > 0 {
			rows = append(rows, r)
		}
	}
	if len(rows) != len(want) {
		t.Fatalf("dump printed:\n%s", out.String())
	}
	for i, w := range want {
		if !slices.Equal(rows[i], w) {
			t.Errorf("row %d: %q, want %q", i, rows[i], w)
		}
	}
	if strings.Contains(out.String(), "iptables counts") {
		t.Errorf("the iptables note on a BPF datapath:\n%s", out.String())
	}
}

// The uplinks and what makes each one, covered or not, then the hooks.
func TestDumpUplinks(t *testing.T) {
	r := &datapathtest.HookBackend{NATBackend: datapathtest.NATBackend{Installed: natReader.Installed},
		Uplink: []datapath.Uplink{
			{Device: "eth0", Ifindex: 2, Via: "default route", Covered: true},
			{Device: "eth1", Ifindex: 3, Via: "route 198.18.0.0/15 table 100", Covered: true},
			{Device: "eth2", Ifindex: 4, Via: "former uplink, draining", Covered: true, Note: "kept while 2 flows of 10.97.0.1 last"},
			{Device: "wg0", Ifindex: 9, Via: "route 100.64.0.0/10", Note: "no Ethernet header: the programs cannot run there"},
		},
		Hook: []datapath.Hook{{Device: "eth0", Ifindex: 2, Direction: "egress"}}}
	var out bytes.Buffer
	if err := writeReader(context.Background(), &out, r, 1); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{
		"uplinks\nDEVICE  IFINDEX  VIA                            COVERED\n" +
			"eth0    2        default route                  yes\n" +
			"eth1    3        route 198.18.0.0/15 table 100  yes\n" +
			"eth2    4        former uplink, draining        yes: kept while 2 flows of 10.97.0.1 last\n" +
			"wg0     9        route 100.64.0.0/10            NO: no Ethernet header: the programs cannot run there\n",
		"\nhooks\n",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("dump lacks %q:\n%s", want, s)
		}
	}
	if strings.Index(s, "uplinks") > strings.Index(s, "hooks") {
		t.Errorf("the hooks before the uplinks:\n%s", s)
	}
}
