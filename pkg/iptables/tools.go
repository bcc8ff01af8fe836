package iptables

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Mode is the kernel interface the iptables tools use.
type Mode string

const (
	// ModeNFT is iptables-nft: the iptables syntax on nf_tables.
	ModeNFT Mode = "nft"
	// ModeLegacy is iptables-legacy: the x_tables kernel interface.
	ModeLegacy Mode = "legacy"
)

// debianPackage is what provides every iptables tool the backend runs, on Debian and Ubuntu.
const debianPackage = "iptables"

// tools are the resolved commands of one mode and family.
type tools struct {
	mode          Mode
	save, restore string
	// list is the iptables command itself (iptables-nft, ip6tables, ...), for listing one chain
	// cheaply; empty when it is not installed, and then the save tool is used instead.
	list string
	// version is the restore tool's version, e.g. {1, 8, 9}.
	version [3]int
}

// atLeast reports whether the tools are at least version major.minor.patch.
func (t *tools) atLeast(major, minor, patch int) bool {
	v := t.version
	want := [3]int{major, minor, patch}
	for i := range v {
		if v[i] != want[i] {
			return v[i] > want[i]
		}
	}
	return true
}

var versionRE = regexp.MustCompile(`v(\d+)\.(\d+)(?:\.(\d+))?`)

// parseVersion reads "iptables-restore v1.8.9 (nf_tables)" and reports whether the tool is the
// nf_tables variant.
func parseVersion(out string) (v [3]int, nft bool, ok bool) {
	m := versionRE.FindStringSubmatch(out)
	if m == nil {
		return v, false, false
	}
	for i := range 3 {
		if m[i+1] != "" {
			v[i], _ = strconv.Atoi(m[i+1])
		}
	}
	return v, strings.Contains(out, "(nf_tables)"), true
}

// prefix is "iptables" or "ip6tables".
func prefix(fam policy.Family) string {
	if fam == policy.IPv6 {
		return "ip6tables"
	}
	return "iptables"
}

// resolveTools finds the save and restore tools of a mode and family. The mode-specific names
// (iptables-nft-restore) come first; the plain names (iptables-restore) are accepted when their
// --version says they are that mode, as on distributions that ship only one variant.
func resolveTools(ctx context.Context, r Runner, mode Mode, fam policy.Family) (*tools, error) {
	p := prefix(fam)
	for _, variant := range []string{p + "-" + string(mode), p} {
		save, restore := variant+"-save", variant+"-restore"
		if r.LookPath(save) != nil || r.LookPath(restore) != nil {
			continue
		}
		out, err := r.Run(ctx, nil, restore, "--version")
		if err != nil {
			return nil, fmt.Errorf("%s --version: %w", restore, err)
		}
		v, nft, ok := parseVersion(string(out))
		if !ok {
			return nil, fmt.Errorf("%s --version: unexpected output %q", restore, strings.TrimSpace(string(out)))
		}
		if nft != (mode == ModeNFT) {
			continue
		}
		t := &tools{mode: mode, save: save, restore: restore, version: v}
		if r.LookPath(variant) == nil {
			t.list = variant
		}
		return t, nil
	}
	return nil, &MissingToolsError{Mode: mode, Family: fam}
}

// MissingToolsError says which tools are missing and what provides them.
type MissingToolsError struct {
	Mode   Mode
	Family policy.Family
}

func (e *MissingToolsError) Error() string {
	p := prefix(e.Family)
	return fmt.Sprintf("%s-%s-restore and %s-%s-save (or %s-restore in %s mode) not found in PATH: install the %q package (apt-get install %s)",
		p, e.Mode, p, e.Mode, p, e.Mode, debianPackage, debianPackage)
}

// ModeChoice is the outcome of DetectMode and why.
type ModeChoice struct {
	Mode   Mode
	Reason string
}

// kubeletHintChain is the chain kubelet creates in the mangle table of the mode it uses (the
// same hint kube-proxy's iptables-wrapper reads first).
const kubeletHintChain = "KUBE-IPTABLES-HINT"

// DetectMode chooses the mode the node already uses, as kube-proxy's iptables-wrapper does:
// kubelet's hint chain decides when present; otherwise the mode holding more rules (IPv4 and
// IPv6 together) wins; nf_tables when neither holds any, or when only its tools are installed.
// Reading a mode's rules through iptables-save without -t loads no kernel module.
func DetectMode(ctx context.Context, r Runner) (ModeChoice, error) {
	var avail []Mode
	for _, m := range []Mode{ModeNFT, ModeLegacy} {
		if _, err := resolveTools(ctx, r, m, policy.IPv4); err == nil {
			avail = append(avail, m)
		}
	}
	switch len(avail) {
	case 0:
		return ModeChoice{}, fmt.Errorf("no iptables tools found in PATH: install the %q package (apt-get install %s)", debianPackage, debianPackage)
	case 1:
		return ModeChoice{Mode: avail[0], Reason: "only " + string(avail[0]) + " tools are installed"}, nil
	}
	rules := map[Mode]int{}
	for _, m := range avail {
		for _, fam := range policy.Families() {
			t, err := resolveTools(ctx, r, m, fam)
			if err != nil {
				continue
			}
			out, err := r.Run(ctx, nil, t.save)
			if err != nil {
				// A kernel without this mode (or without IPv6) holds no rules in it.
				continue
			}
			mangle, err := ParseSave(out, "mangle")
			if err == nil && mangle.HasChain(kubeletHintChain) {
				return ModeChoice{Mode: m, Reason: fmt.Sprintf("kubelet's %s chain is in %s", kubeletHintChain, m)}, nil
			}
			rules[m] += countRules(out)
		}
	}
	if rules[ModeLegacy] > rules[ModeNFT] {
		return ModeChoice{Mode: ModeLegacy, Reason: fmt.Sprintf("legacy holds %d rules, nft %d", rules[ModeLegacy], rules[ModeNFT])}, nil
	}
	return ModeChoice{Mode: ModeNFT, Reason: fmt.Sprintf("nft holds %d rules, legacy %d", rules[ModeNFT], rules[ModeLegacy])}, nil
}

// countRules counts the rule lines of an iptables-save dump, in every table.
func countRules(out []byte) int {
	n := 0
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "-A ") || strings.HasPrefix(l, "[") {
			n++
		}
	}
	return n
}
