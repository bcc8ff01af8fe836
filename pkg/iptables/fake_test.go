package iptables

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// fakeRule is a rule of the fake kernel: text in iptables-save form plus counters.
type fakeRule struct {
	text           string
	packets, bytes uint64
}

// fakeTable is one table of one mode and family.
type fakeTable struct {
	chains []string // declaration order, built-ins first
	rules  map[string][]fakeRule
}

func newFakeTable(builtins ...string) *fakeTable {
	return &fakeTable{chains: slices.Clone(builtins), rules: map[string][]fakeRule{}}
}

func (t *fakeTable) clone() *fakeTable {
	c := &fakeTable{chains: slices.Clone(t.chains), rules: map[string][]fakeRule{}}
	for k, v := range t.rules {
		c.rules[k] = slices.Clone(v)
	}
	return c
}

func (t *fakeTable) has(chain string) bool { return slices.Contains(t.chains, chain) }

var natBuiltins = []string{"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}

// fakeStack is what one mode and family of the fake holds.
type fakeStack struct {
	tables map[string]*fakeTable
}

// fakeIptables is an in-memory iptables: save and restore --noflush of both modes and families,
// with the semantics the backend relies on (a chain declaration flushes, -D needs an exact match,
// -X needs an unreferenced chain, a transaction applies whole or not at all).
type fakeIptables struct {
	// mu makes each tool run atomic, as the xtables lock does, for tests that read while the
	// backend applies.
	mu sync.Mutex
	// installed are the tool names in PATH.
	installed map[string]bool
	// version is what every restore tool prints for --version (without the mode suffix).
	version string
	// rejectRandomFully makes the "kernel" refuse --random-fully.
	rejectRandomFully bool
	// failRestore, when set, fails every restore whose payload contains it.
	failRestore string
	stacks      map[string]*fakeStack // key: mode/family
	calls       []fakeCall
}

type fakeCall struct {
	name  string
	args  []string
	stdin string
}

func newFakeIptables() *fakeIptables {
	f := &fakeIptables{installed: map[string]bool{}, version: "v1.8.9", stacks: map[string]*fakeStack{}}
	for _, p := range []string{"iptables", "ip6tables"} {
		for _, v := range []string{"-nft", "-legacy", ""} {
			f.installed[p+v+"-save"] = true
			f.installed[p+v+"-restore"] = true
			f.installed[p+v] = true
		}
	}
	return f
}

// toolMode maps a tool name to its mode, family and verb; plain names are nft, as on Debian.
func toolMode(name string) (Mode, policy.Family, string) {
	fam := policy.IPv4
	if strings.HasPrefix(name, "ip6tables") {
		fam = policy.IPv6
	}
	mode := ModeNFT
	if strings.Contains(name, "-legacy") {
		mode = ModeLegacy
	}
	verb := name[strings.LastIndex(name, "-")+1:]
	return mode, fam, verb
}

func (f *fakeIptables) stack(mode Mode, fam policy.Family) *fakeStack {
	key := fmt.Sprintf("%s/%s", mode, fam)
	s, ok := f.stacks[key]
	if !ok {
		s = &fakeStack{tables: map[string]*fakeTable{}}
		f.stacks[key] = s
	}
	return s
}

// nat returns a stack's nat table, creating it as using it would.
func (f *fakeIptables) nat(mode Mode, fam policy.Family) *fakeTable {
	s := f.stack(mode, fam)
	if s.tables["nat"] == nil {
		s.tables["nat"] = newFakeTable(natBuiltins...)
	}
	return s.tables["nat"]
}

func (f *fakeIptables) LookPath(name string) error {
	if !f.installed[name] {
		return &exec.Error{Name: name, Err: exec.ErrNotFound}
	}
	return nil
}

func (f *fakeIptables) Run(_ context.Context, stdin []byte, name string, args ...string) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fakeCall{name: name, args: args, stdin: string(stdin)})
	if !f.installed[name] {
		return nil, &ExecError{Command: name, Err: exec.ErrNotFound}
	}
	mode, fam, verb := toolMode(name)
	if slices.Contains(args, "--version") {
		suffix := " (legacy)"
		if mode == ModeNFT {
			suffix = " (nf_tables)"
		}
		return []byte(fmt.Sprintf("%s-%s %s%s\n", prefix(fam), verb, f.version, suffix)), nil
	}
	switch verb {
	case "nft", "legacy", "iptables", "ip6tables":
		return f.list(mode, fam, name, args)
	case "save":
		return f.save(mode, fam, args), nil
	case "restore":
		if !slices.Contains(args, "--noflush") {
			return nil, fmt.Errorf("fake: restore without --noflush would flush the table")
		}
		if err := f.restore(mode, fam, string(stdin), slices.Contains(args, "--counters")); err != nil {
			return nil, &ExecError{Command: name + " " + strings.Join(args, " "), Stderr: err.Error() + "\n", Err: fmt.Errorf("exit status 1")}
		}
		return nil, nil
	}
	return nil, fmt.Errorf("fake: unknown tool %s", name)
}

func (f *fakeIptables) save(mode Mode, fam policy.Family, args []string) []byte {
	counters := slices.Contains(args, "-c")
	s := f.stack(mode, fam)
	var tables []string
	if i := slices.Index(args, "-t"); i >= 0 {
		tables = []string{args[i+1]}
		if args[i+1] == "nat" {
			f.nat(mode, fam) // naming a table loads it, as the legacy kernel does
		}
	} else {
		for name := range s.tables {
			tables = append(tables, name)
		}
		slices.Sort(tables)
	}
	var b strings.Builder
	b.WriteString("# Generated by fake iptables-save\n")
	for _, name := range tables {
		t := s.tables[name]
		if t == nil {
			continue
		}
		fmt.Fprintf(&b, "*%s\n", name)
		for _, c := range t.chains {
			policy := "-"
			if slices.Contains(natBuiltins, c) || slices.Contains([]string{"FORWARD"}, c) {
				policy = "ACCEPT"
			}
			fmt.Fprintf(&b, ":%s %s [0:0]\n", c, policy)
		}
		for _, c := range t.chains {
			for _, r := range t.rules[c] {
				if counters {
					fmt.Fprintf(&b, "[%d:%d] ", r.packets, r.bytes)
				}
				b.WriteString(r.text + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return []byte(b.String())
}

// list answers `iptables [--wait] -t nat -S CHAIN` as iptables does.
func (f *fakeIptables) list(mode Mode, fam policy.Family, name string, args []string) ([]byte, error) {
	args = slices.DeleteFunc(slices.Clone(args), func(a string) bool { return a == "--wait" || a == "-w" })
	if len(args) != 4 || args[0] != "-t" || args[1] != "nat" || args[2] != "-S" {
		return nil, fmt.Errorf("fake: %s %q not supported", name, args)
	}
	t, chain := f.nat(mode, fam), args[3]
	if !t.has(chain) {
		return nil, &ExecError{Command: name + " " + strings.Join(args, " "),
			Stderr: "iptables: No chain/target/match by that name.\n", Err: fmt.Errorf("exit status 1")}
	}
	var b strings.Builder
	if slices.Contains(natBuiltins, chain) {
		fmt.Fprintf(&b, "-P %s ACCEPT\n", chain)
	} else {
		fmt.Fprintf(&b, "-N %s\n", chain)
	}
	for _, r := range t.rules[chain] {
		b.WriteString(r.text + "\n")
	}
	return []byte(b.String()), nil
}

var fakeTargets = []string{"RETURN", "MASQUERADE", "ACCEPT", "DROP"}

// restore applies a payload. A rule line may start with "[packets:bytes] ", which sets the new
// rule's counters with --counters (withCounters) and is ignored without, as iptables does.
func (f *fakeIptables) restore(mode Mode, fam policy.Family, payload string, withCounters bool) error {
	if f.failRestore != "" && strings.Contains(payload, f.failRestore) {
		return fmt.Errorf("iptables-restore: line 2 failed: No chain/target/match by that name.")
	}
	s := f.stack(mode, fam)
	var work *fakeTable
	table := ""
	for n, line := range strings.Split(payload, "\n") {
		n++
		fail := func(msg string) error {
			return fmt.Errorf("iptables-restore v1.8.9: %s\n\nError occurred at line: %d\nTry `iptables-restore -h' or 'iptables-restore --help' for more information.", msg, n)
		}
		switch {
		case line == "" || line[0] == '#':
		case line[0] == '*':
			table = line[1:]
			if table != "nat" {
				return fail("fake supports only nat")
			}
			work = f.nat(mode, fam).clone()
		case line == "COMMIT":
			s.tables[table] = work
			work = nil
		case work == nil:
			return fail("rule outside a table")
		case line[0] == ':':
			name, _, _ := strings.Cut(line[1:], " ")
			if work.has(name) {
				work.rules[name] = nil // --noflush: declaring a chain flushes it
			} else {
				work.chains = append(work.chains, name)
			}
		default:
			var packets, bytes uint64
			if line[0] == '[' {
				counters, rest, ok := strings.Cut(line[1:], "] ")
				if _, err := fmt.Sscanf(counters, "%d:%d", &packets, &bytes); !ok || err != nil {
					return fail("bad counters")
				}
				line = rest
				if !withCounters {
					packets, bytes = 0, 0
				}
			}
			fields := strings.Fields(line)
			if len(fields) < 2 {
				return fail("bad line")
			}
			chain := fields[1]
			if !work.has(chain) {
				return fail(fmt.Sprintf("chain %s does not exist", chain))
			}
			switch fields[0] {
			case "-A":
				target := fields[slices.Index(fields, "-j")+1]
				if !slices.Contains(fakeTargets, target) && !work.has(target) {
					return fail(fmt.Sprintf("Couldn't load target `%s'", target))
				}
				if f.rejectRandomFully && slices.Contains(fields, "--random-fully") {
					return fmt.Errorf("iptables-restore: line %d failed: Invalid argument", n)
				}
				work.rules[chain] = append(work.rules[chain], fakeRule{text: line, packets: packets, bytes: bytes})
			case "-D":
				want := "-A" + strings.TrimPrefix(line, "-D")
				i := slices.IndexFunc(work.rules[chain], func(r fakeRule) bool { return r.text == want })
				if i < 0 {
					return fmt.Errorf("iptables-restore: line %d failed: Bad rule (does a matching rule exist in that chain?).", n)
				}
				work.rules[chain] = slices.Delete(work.rules[chain], i, i+1)
			case "-X":
				for c, rules := range work.rules {
					for _, r := range rules {
						if strings.HasSuffix(r.text, "-j "+chain) && c != chain {
							return fmt.Errorf("iptables-restore: line %d failed: Directory not empty.", n)
						}
					}
				}
				if len(work.rules[chain]) > 0 {
					return fmt.Errorf("iptables-restore: line %d failed: Directory not empty.", n)
				}
				delete(work.rules, chain)
				work.chains = slices.DeleteFunc(work.chains, func(c string) bool { return c == chain })
			default:
				return fail("unsupported command " + fields[0])
			}
		}
	}
	if work != nil {
		return fmt.Errorf("iptables-restore: COMMIT expected at line %d", strings.Count(payload, "\n")+1)
	}
	return nil
}

// chainTexts returns the rule texts of a chain.
func (f *fakeIptables) chainTexts(mode Mode, fam policy.Family, chain string) []string {
	var out []string
	for _, r := range f.nat(mode, fam).rules[chain] {
		out = append(out, r.text)
	}
	return out
}

// restores returns the payloads of the restore calls made so far.
func (f *fakeIptables) restores() []string {
	var out []string
	for _, c := range f.calls {
		if strings.HasSuffix(c.name, "-restore") && !slices.Contains(c.args, "--version") {
			out = append(out, c.stdin)
		}
	}
	return out
}
