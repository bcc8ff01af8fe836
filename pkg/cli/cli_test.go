package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func run(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := Run(testContext(t), args, &out, &errOut)
	return out.String(), errOut.String(), err
}

// testContext names a node lock of the test's own, which nothing holds: explain and dump, run in
// the host's namespace, never ask an agent running there.
func testContext(t *testing.T) context.Context {
	t.Helper()
	return context.WithValue(context.Background(), lockNameKey{}, "ip-masq-agent-test-"+rand.Text())
}

func writeConfig(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

const seedScenario3 = `masqueradeCIDRs:
  - 10.10.10.10/32
nonMasqueradeCIDRs:
  - 10.0.0.0/8
  - 172.16.0.0/12
  - 100.64.230.0/24
  - 192.168.0.0/16
  - fc00::/7
masqOutBound: false
masqOutBoundIPv6: true
`

func TestExplain(t *testing.T) {
	path := writeConfig(t, seedScenario3)
	// Flags before, between and after the addresses; both --flag value and --flag=value.
	out, stderr, err := run(t, "explain", "10.10.10.10", "--config", path, "172.16.5.5", "--enable-ipv6=true", "8.8.8.8", "fd00::1", "2001:db8::1", "169.254.169.254")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	want := [][]string{
		{"ADDRESS", "VERDICT", "SOURCE", "RULE", "CIDR", "FROM"},
		{"10.10.10.10", "MASQUERADE", "uplink", "ipv4", "#1", "10.10.10.10/32", "masqueradeCIDRs[0]"},
		{"172.16.5.5", "RETURN", "pod", "ipv4", "#4", "172.16.0.0/12", "nonMasqueradeCIDRs[1]"},
		{"8.8.8.8", "RETURN", "pod", "-", "-", "no", "rule", "matched", "and", "masqOutBound", "is", "false:", "end", "of", "chain"},
		{"fd00::1", "RETURN", "pod", "ipv6", "#2", "fc00::/7", "nonMasqueradeCIDRs[4]"},
		{"2001:db8::1", "MASQUERADE", "uplink", "ipv6", "#3", "::/0", "masqOutBoundIPv6:", "true"},
		{"169.254.169.254", "RETURN", "pod", "ipv4", "#2", "169.254.0.0/16", "link-local", "(masqLinkLocal:", "false)"},
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines:\n%s", len(lines), out)
	}
	for i, w := range want {
		if got := strings.Fields(lines[i]); strings.Join(got, " ") != strings.Join(w, " ") {
			t.Errorf("line %d:\n got  %q\n want %q", i, got, w)
		}
	}
	if want := "config: file " + path + " (no running agent answered)\n"; stderr != want {
		t.Errorf("stderr %q, want %q", stderr, want)
	}
}

func TestExplainErrors(t *testing.T) {
	bad := writeConfig(t, "nonMasqueradeCIDRs: [10.0.0.1/8]")
	for _, tt := range []struct {
		args     []string
		wantErr  string
		wantCode int
	}{
		{[]string{"explain"}, "at least one address", 2},
		{[]string{"explain", "not-an-ip"}, `"not-an-ip" is not an IP address`, 2},
		{[]string{"explain", "--config", bad, "1.2.3.4"}, `"10.0.0.1/8": host bits are set; did you mean "10.0.0.0/8"?`, 1},
		{[]string{"explain", "--no-such-flag", "1.2.3.4"}, "flag provided but not defined", 2},
		{[]string{"explain", "--to-ports", "9-1", "1.2.3.4"}, "starts after it ends", 2},
		{[]string{"explain", "--masq-chain", "A B", "1.2.3.4"}, "masq-chain", 2},
		{[]string{"frobnicate"}, `unknown command "frobnicate"`, 2},
	} {
		_, _, err := run(t, tt.args...)
		if err == nil || !strings.Contains(err.Error(), tt.wantErr) || ExitCode(err) != tt.wantCode {
			t.Errorf("%q: err %v (exit %d), want %q (exit %d)", tt.args, err, ExitCode(err), tt.wantErr, tt.wantCode)
		}
	}
}

// explainRows are the rows of explain's table (without its header), each row's fields.
func explainRows(out string) [][]string {
	table, _, _ := strings.Cut(out, "\n\n")
	var rows [][]string
	for _, l := range strings.Split(strings.TrimSpace(table), "\n")[1:] {
		rows = append(rows, strings.Fields(l))
	}
	return rows
}

// TestExplainAddresses: explain shows the address each destination leaves from: an entry's own,
// the family's masqueradeAddress, the uplink's, or the pod's.
func TestExplainAddresses(t *testing.T) {
	path := writeConfig(t, `masqueradeAddress: 192.0.2.11
masqueradeAddressIPv6: "2001:db8::11"
masqueradeCIDRs:
  - {cidr: 10.10.10.10/32, address: 192.0.2.12}
  - 10.20.0.0/16
nonMasqueradeCIDRs: [10.0.0.0/8]
`)
	out, _, err := run(t, "explain", "--config", path, "--enable-ipv6", "10.10.10.10", "10.20.1.1", "8.8.8.8", "10.1.2.3", "2001:db8::1")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"10.10.10.10": "192.0.2.12", "10.20.1.1": "192.0.2.11", "8.8.8.8": "192.0.2.11",
		"10.1.2.3": "pod", "2001:db8::1": "2001:db8::11"}
	for _, f := range explainRows(out) {
		if want[f[0]] != f[2] {
			t.Errorf("%s leaves from %s, want %s:\n%s", f[0], f[2], want[f[0]], out)
		}
	}
}

// TestExplainDirectory: --config may name a directory, whose --config-pattern files are merged.
func TestExplainDirectory(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{"ip-masq-platform": "nonMasqueradeCIDRs: [10.0.0.0/8]\n",
		"ip-masq-user": "masqueradeCIDRs: [10.10.10.10/32]\n", "user.yaml": "nonMasqueradeCIDRs: [172.16.0.0/12]\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out, _, err := run(t, "explain", "--config", dir, "10.10.10.10", "10.1.2.3", "172.16.5.5")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"10.10.10.10  MASQUERADE  uplink  ipv4 #1", "10.1.2.3     RETURN      pod     ipv4 #3", "172.16.5.5   MASQUERADE  uplink  ipv4 #4"} {
		if !strings.Contains(out, want) {
			t.Errorf("explain of the merged directory lacks %q:\n%s", want, out)
		}
	}
	out, _, err = run(t, "explain", "--config", dir, "--config-pattern", "*.yaml", "172.16.5.5")
	if err != nil || !strings.Contains(out, "172.16.5.5  RETURN") {
		t.Errorf("explain with --config-pattern *.yaml: %v\n%s", err, out)
	}
	if _, _, err := run(t, "explain", "--config", dir, "--config-pattern", "conf/*", "1.2.3.4"); err == nil || ExitCode(err) != 2 ||
		!strings.Contains(err.Error(), "config-pattern") {
		t.Errorf("a bad --config-pattern: %v (exit %d), want a usage error", err, ExitCode(err))
	}
}

// "--" ends the flags, so an argument that looks like a flag is taken as an address.
func TestDoubleDash(t *testing.T) {
	_, _, err := run(t, "explain", "--config", writeConfig(t, ""), "--", "--enable-ipv6")
	if err == nil || !strings.Contains(err.Error(), `"--enable-ipv6" is not an IP address`) {
		t.Errorf("err = %v", err)
	}
}

func TestRender(t *testing.T) {
	path := writeConfig(t, seedScenario3)
	out, _, err := run(t, "render", "--config="+path, "--enable-ipv6", "--masq-chain", "MY-MASQ", "--random-fully=false", "--to-ports=40000-50000")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(path, config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	p := policy.Compile(cfg, policy.Options{EnableIPv6: true, ToPorts: policy.PortRanges{{First: 40000, Last: 50000}}})
	if want := iptables.RenderAll(p, "MY-MASQ"); out != want {
		t.Errorf("render printed:\n%s\nwant:\n%s", out, want)
	}
	if strings.Contains(out, "random-fully") || !strings.Contains(out, "--to-ports 40000-50000") || !strings.Contains(out, ":MY-MASQ - [0:0]") {
		t.Errorf("flags not honoured:\n%s", out)
	}
	if _, _, err := run(t, "render", "extra"); err == nil || ExitCode(err) != 2 {
		t.Errorf("render with an argument: %v", err)
	}
}

// render --backend nftables prints the nftables transactions for the same flags; bpf has none.
func TestRenderNftables(t *testing.T) {
	path := writeConfig(t, seedScenario3)
	out, _, err := run(t, "render", "--config="+path, "--enable-ipv6", "--backend=nftables", "--to-ports=40000-50000")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(path, config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	p := policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true, ToPorts: policy.PortRanges{{First: 40000, Last: 50000}}})
	if want := nftables.RenderAll(p); out != want {
		t.Errorf("render printed:\n%s\nwant:\n%s", out, want)
	}
	if !strings.Contains(out, "masquerade to :40000-50000 fully-random") || !strings.Contains(out, "add table ip6 ip-masq-agent") {
		t.Errorf("flags not honoured:\n%s", out)
	}
	if _, _, err := run(t, "render", "--backend=bpf"); err == nil || ExitCode(err) != 2 || !strings.Contains(err.Error(), "must be nftables or iptables") {
		t.Errorf("render --backend=bpf: %v", err)
	}
}

func TestRenderReservedRanges(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "none")
	out, _, err := run(t, "render", "--config", missing, "--nomasq-all-reserved-ranges")
	if err != nil {
		t.Fatal(err)
	}
	for _, cidr := range []string{"100.64.0.0/10", "198.18.0.0/15", "240.0.0.0/4"} {
		if !strings.Contains(out, "-d "+cidr+" ") {
			t.Errorf("render lacks %s:\n%s", cidr, out)
		}
	}
}

func TestVersionAndHelp(t *testing.T) {
	out, _, err := run(t, "version")
	if err != nil || !strings.HasPrefix(out, "ip-masq-agent ") {
		t.Errorf("version: %q, %v", out, err)
	}
	out, _, err = run(t, "help")
	if err != nil || !strings.Contains(out, "explain") || !strings.Contains(out, "render") {
		t.Errorf("help: %q, %v", out, err)
	}
	if out := helpOf(t, "explain"); !strings.Contains(out, "-enable-ipv6") {
		t.Errorf("explain --help: %q", out)
	}
}
