package cli

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

const sourceRulesConfig = `
nonMasqueradeCIDRs: [10.0.0.0/8]
sourceRules:
- name: partner
  cidrs: [10.244.1.0/24]
  nonMasqueradeCIDRs: [10.0.0.0/8, 203.0.113.0/24]
- name: quiet
  cidrs: [10.244.0.0/16]
  masqOutBound: false
`

// --from names the source rule that holds the source, and the verdicts are that rule's; a
// source none holds is decided by the global lists, and without --from explain says that its
// verdicts are for such a source.
func TestExplainFrom(t *testing.T) {
	path := writeConfig(t, sourceRulesConfig)
	for _, c := range []struct {
		from, head string
		rows       [][]string
	}{
		{"10.244.1.5", "from 10.244.1.5: source rule partner (sourceRules[0]: cidrs[0] 10.244.1.0/24) decides by its keys over the global ones",
			[][]string{
				{"203.0.113.1", "RETURN", "pod", "ipv4", "#3", "203.0.113.0/24", "sourceRules[partner].nonMasqueradeCIDRs[1]"},
				{"8.8.8.8", "MASQUERADE", "uplink", "ipv4", "#4", "0.0.0.0/0", "sourceRules[partner].masqOutBound:", "true"},
			}},
		{"10.244.7.1", "from 10.244.7.1: source rule quiet (sourceRules[1]: cidrs[0] 10.244.0.0/16) decides by its keys over the global ones",
			[][]string{
				{"203.0.113.1", "RETURN", "pod", "-", "-", "source", "rule", "quiet:", "no", "rule", "matched", "and", "masqOutBound", "is", "false:", "end", "of", "chain"},
				{"8.8.8.8", "RETURN", "pod", "-", "-", "source", "rule", "quiet:", "no", "rule", "matched", "and", "masqOutBound", "is", "false:", "end", "of", "chain"},
			}},
		{"10.245.0.1", "from 10.245.0.1: no source rule holds it: the global keys decide",
			[][]string{
				{"203.0.113.1", "MASQUERADE", "uplink", "ipv4", "#3", "0.0.0.0/0", "masqOutBound:", "true"},
				{"8.8.8.8", "MASQUERADE", "uplink", "ipv4", "#3", "0.0.0.0/0", "masqOutBound:", "true"},
			}},
	} {
		out, stderr, err := run(t, "explain", "--config", path, "--from", c.from, "203.0.113.1", "8.8.8.8")
		if err != nil {
			t.Fatal(err)
		}
		head, table, _ := strings.Cut(out, "\n")
		if head != c.head {
			t.Errorf("--from %s: first line\n got  %q\n want %q", c.from, head, c.head)
		}
		rows := explainRows(table)
		if len(rows) != len(c.rows) {
			t.Fatalf("--from %s: %d rows:\n%s", c.from, len(rows), out)
		}
		for i := range rows {
			if strings.Join(rows[i], " ") != strings.Join(c.rows[i], " ") {
				t.Errorf("--from %s row %d:\n got  %q\n want %q", c.from, i, rows[i], c.rows[i])
			}
		}
		if strings.Contains(stderr, "note:") {
			t.Errorf("--from %s: stderr %q notes the source rules", c.from, stderr)
		}
	}
	_, stderr, err := run(t, "explain", "--config", path, "8.8.8.8")
	if err != nil || !strings.Contains(stderr, "note: 2 source rules decide the traffic of their own sources") {
		t.Errorf("without --from: stderr %q, %v", stderr, err)
	}
	for _, bad := range []string{"nonsense", "ns/", "/pod", "a/b/c"} {
		_, _, err := run(t, "explain", "--config", path, "--from", bad, "8.8.8.8")
		if err == nil || ExitCode(err) != 2 || !strings.Contains(err.Error(), "want an IP address or NAMESPACE/POD") {
			t.Errorf("--from %q: %v (exit %d)", bad, err, ExitCode(err))
		}
	}
}

// dump lists the source rules in their order, each with its sources: its CIDRs, its selectors
// and the pods they chose.
func TestWriteSourceRules(t *testing.T) {
	cfg, err := config.Parse([]byte(sourceRulesConfig+`- name: batch
  namespaceSelector: {matchLabels: {team: batch}}
`), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := policy.Compile(cfg, policy.Options{Pods: map[string][]netip.Addr{"batch": {netip.MustParseAddr("10.244.9.3")}}})
	var b strings.Builder
	if err := writeSourceRules(&b, p); err != nil {
		t.Fatal(err)
	}
	want := [][]string{
		{"#", "NAME", "CIDRS", "SELECTORS", "PODS"},
		{"0", "partner", "10.244.1.0/24", "-", "-"},
		{"1", "quiet", "10.244.0.0/16", "-", "-"},
		{"2", "batch", "-", "namespaceSelector", "team=batch", "1", "(10.244.9.3)"},
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")[1:]
	if len(lines) != len(want) {
		t.Fatalf("dump's source rules:\n%s", b.String())
	}
	for i, l := range lines {
		if got := strings.Fields(l); strings.Join(got, " ") != strings.Join(want[i], " ") {
			t.Errorf("line %d: %q, want %q", i, got, want[i])
		}
	}
}
