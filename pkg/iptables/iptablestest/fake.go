// Package iptablestest is an in-memory iptables for tests: the save, restore and list tools of
// both modes and families behind the iptables.Runner interface, so that the backend, dump and
// anything else that runs iptables can be tested without root.
package iptablestest

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Rule is a rule of the fake kernel: its text in iptables-save form ("-A CHAIN ...") and its
// counters.
type Rule struct {
	Text           string
	Packets, Bytes uint64
}

// Table is one table of one mode and family.
type Table struct {
	// Chains are in declaration order, built-ins first.
	Chains []string
	// Rules are each chain's rules, in order.
	Rules map[string][]Rule
}

// NewTable returns a table holding only the named (built-in) chains.
func NewTable(builtins ...string) *Table {
	return &Table{Chains: slices.Clone(builtins), Rules: map[string][]Rule{}}
}

func (t *Table) clone() *Table {
	c := &Table{Chains: slices.Clone(t.Chains), Rules: map[string][]Rule{}}
	for k, v := range t.Rules {
		c.Rules[k] = slices.Clone(v)
	}
	return c
}

// Has reports whether the table declares the chain.
func (t *Table) Has(chain string) bool { return slices.Contains(t.Chains, chain) }

var natBuiltins = []string{"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}

// Stack is what one mode and family of the fake holds: its tables by name.
type Stack struct {
	Tables map[string]*Table
}

// Fake is an in-memory iptables: save, restore --noflush and list (-S) of both modes and
// families, with the semantics the backend relies on (a chain declaration flushes, -D needs an
// exact match, -X needs an unreferenced chain, a transaction applies whole or not at all). Its
// fields and tables may be changed between tool runs, to set a node up or damage it.
type Fake struct {
	// mu makes each tool run atomic, as the xtables lock does, for tests that read while the
	// backend applies.
	mu sync.Mutex
	// Installed are the tool names in PATH; New installs every tool of both modes and families,
	// and the plain names (iptables-save, ...) as nft, as on Debian.
	Installed map[string]bool
	// Version is what every restore tool prints for --version (without the mode suffix).
	Version string
	// RejectRandomFully makes the "kernel" refuse --random-fully.
	RejectRandomFully bool
	// FailRestore, when set, fails every restore whose payload contains it.
	FailRestore string
	// LockFile, when set, is an xtables lock file that cannot be opened: every restore of the
	// legacy tools fails as iptables-legacy does then, before reading its input.
	LockFile string
	// Stacks are the tables of each mode and family, by Key.
	Stacks map[string]*Stack
	// Calls are the tool runs so far.
	Calls []Call
}

// Call is one tool run.
type Call struct {
	Name  string
	Args  []string
	Stdin string
}

var _ iptables.Runner = (*Fake)(nil)

// New returns a fake node with every tool installed and no rules.
func New() *Fake {
	f := &Fake{Installed: map[string]bool{}, Version: "v1.8.9", Stacks: map[string]*Stack{}}
	for _, p := range []string{"iptables", "ip6tables"} {
		for _, v := range []string{"-nft", "-legacy", ""} {
			f.Installed[p+v+"-save"] = true
			f.Installed[p+v+"-restore"] = true
			f.Installed[p+v] = true
		}
	}
	return f
}

// Uninstall removes from PATH every tool whose name contains one of the parts.
func (f *Fake) Uninstall(parts ...string) {
	for name := range f.Installed {
		for _, part := range parts {
			if strings.Contains(name, part) {
				delete(f.Installed, name)
			}
		}
	}
}

// prefix is "iptables" or "ip6tables".
func prefix(fam policy.Family) string {
	if fam == policy.IPv6 {
		return "ip6tables"
	}
	return "iptables"
}

// toolMode maps a tool name to its mode, family and verb; plain names are nft, as on Debian.
func toolMode(name string) (iptables.Mode, policy.Family, string) {
	fam := policy.IPv4
	if strings.HasPrefix(name, "ip6tables") {
		fam = policy.IPv6
	}
	mode := iptables.ModeNFT
	if strings.Contains(name, "-legacy") {
		mode = iptables.ModeLegacy
	}
	verb := name[strings.LastIndex(name, "-")+1:]
	return mode, fam, verb
}

// Key names the stack of a mode and family in Stacks.
func Key(mode iptables.Mode, fam policy.Family) string { return fmt.Sprintf("%s/%s", mode, fam) }

// Stack returns what a mode and family holds, creating it empty.
func (f *Fake) Stack(mode iptables.Mode, fam policy.Family) *Stack {
	s, ok := f.Stacks[Key(mode, fam)]
	if !ok {
		s = &Stack{Tables: map[string]*Table{}}
		f.Stacks[Key(mode, fam)] = s
	}
	return s
}

// NAT returns a stack's nat table, creating it as using it would. A restore replaces the
// table: look it up again after one.
func (f *Fake) NAT(mode iptables.Mode, fam policy.Family) *Table {
	s := f.Stack(mode, fam)
	if s.Tables["nat"] == nil {
		s.Tables["nat"] = NewTable(natBuiltins...)
	}
	return s.Tables["nat"]
}

// LookPath implements iptables.Runner.
func (f *Fake) LookPath(name string) error {
	if !f.Installed[name] {
		return &exec.Error{Name: name, Err: exec.ErrNotFound}
	}
	return nil
}

// Run implements iptables.Runner.
func (f *Fake) Run(_ context.Context, stdin []byte, name string, args ...string) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Calls = append(f.Calls, Call{Name: name, Args: args, Stdin: string(stdin)})
	if !f.Installed[name] {
		return nil, &iptables.ExecError{Command: name, Err: exec.ErrNotFound}
	}
	mode, fam, verb := toolMode(name)
	if slices.Contains(args, "--version") {
		suffix := " (legacy)"
		if mode == iptables.ModeNFT {
			suffix = " (nf_tables)"
		}
		return []byte(fmt.Sprintf("%s-%s %s%s\n", prefix(fam), verb, f.Version, suffix)), nil
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
		if f.LockFile != "" && mode == iptables.ModeLegacy {
			return nil, &iptables.ExecError{Command: name + " " + strings.Join(args, " "),
				Stderr: "Fatal: can't open lock file " + f.LockFile + ": Read-only file system\n", Err: ExitStatus(4)}
		}
		if err := f.restore(mode, fam, string(stdin), slices.Contains(args, "--counters")); err != nil {
			return nil, &iptables.ExecError{Command: name + " " + strings.Join(args, " "), Stderr: err.Error() + "\n", Err: ExitStatus(1)}
		}
		return nil, nil
	}
	return nil, fmt.Errorf("fake: unknown tool %s", name)
}

func (f *Fake) save(mode iptables.Mode, fam policy.Family, args []string) []byte {
	counters := slices.Contains(args, "-c")
	s := f.Stack(mode, fam)
	var tables []string
	if i := slices.Index(args, "-t"); i >= 0 {
		tables = []string{args[i+1]}
		if args[i+1] == "nat" {
			f.NAT(mode, fam) // naming a table loads it, as the legacy kernel does
		}
	} else {
		for name := range s.Tables {
			tables = append(tables, name)
		}
		slices.Sort(tables)
	}
	var b strings.Builder
	b.WriteString("# Generated by fake iptables-save\n")
	for _, name := range tables {
		t := s.Tables[name]
		if t == nil {
			continue
		}
		fmt.Fprintf(&b, "*%s\n", name)
		for _, c := range t.Chains {
			policy := "-"
			if slices.Contains(natBuiltins, c) || c == "FORWARD" {
				policy = "ACCEPT"
			}
			fmt.Fprintf(&b, ":%s %s [0:0]\n", c, policy)
		}
		for _, c := range t.Chains {
			for _, r := range t.Rules[c] {
				if counters {
					fmt.Fprintf(&b, "[%d:%d] ", r.Packets, r.Bytes)
				}
				b.WriteString(r.Text + "\n")
			}
		}
		b.WriteString("COMMIT\n")
	}
	return []byte(b.String())
}

// list answers `iptables [--wait] -t nat -S CHAIN [-v]` as iptables does: with -v, each rule's
// counters as "-c PACKETS BYTES" before its target.
func (f *Fake) list(mode iptables.Mode, fam policy.Family, name string, args []string) ([]byte, error) {
	args = slices.DeleteFunc(slices.Clone(args), func(a string) bool { return a == "--wait" || a == "-w" })
	verbose := len(args) == 5 && args[4] == "-v"
	if verbose {
		args = args[:4]
	}
	if len(args) != 4 || args[0] != "-t" || args[1] != "nat" || args[2] != "-S" {
		return nil, fmt.Errorf("fake: %s %q not supported", name, args)
	}
	t, chain := f.NAT(mode, fam), args[3]
	if !t.Has(chain) {
		return nil, &iptables.ExecError{Command: name + " " + strings.Join(args, " "),
			Stderr: "iptables: No chain/target/match by that name.\n", Err: ExitStatus(1)}
	}
	var b strings.Builder
	counters := func(r Rule) string {
		if !verbose {
			return ""
		}
		return fmt.Sprintf(" -c %d %d", r.Packets, r.Bytes)
	}
	if slices.Contains(natBuiltins, chain) {
		fmt.Fprintf(&b, "-P %s ACCEPT%s\n", chain, counters(Rule{}))
	} else {
		fmt.Fprintf(&b, "-N %s\n", chain)
	}
	for _, r := range t.Rules[chain] {
		text := r.Text
		at := strings.LastIndex(text, " -j ")
		if at < 0 {
			at = strings.LastIndex(text, " -g ")
		}
		if at < 0 {
			at = len(text)
		}
		b.WriteString(text[:at] + counters(r) + text[at:] + "\n")
	}
	return []byte(b.String()), nil
}

// ExitStatus is the exit status of a tool of the fake that failed, as an *exec.ExitError
// reports it.
type ExitStatus int

func (e ExitStatus) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// ExitCode is the status, as exec.ExitError.ExitCode.
func (e ExitStatus) ExitCode() int { return int(e) }

var builtinTargets = []string{"RETURN", "MASQUERADE", "SNAT", "ACCEPT", "DROP"}

// restore applies a payload. A rule line may start with "[packets:bytes] ", which sets the new
// rule's counters with --counters (withCounters) and is ignored without, as iptables does.
func (f *Fake) restore(mode iptables.Mode, fam policy.Family, payload string, withCounters bool) error {
	if f.FailRestore != "" && strings.Contains(payload, f.FailRestore) {
		return fmt.Errorf("iptables-restore: line 2 failed: No chain/target/match by that name.")
	}
	s := f.Stack(mode, fam)
	var work *Table
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
			work = f.NAT(mode, fam).clone()
		case line == "COMMIT":
			s.Tables[table] = work
			work = nil
		case work == nil:
			return fail("rule outside a table")
		case line[0] == ':':
			name, _, _ := strings.Cut(line[1:], " ")
			if work.Has(name) {
				work.Rules[name] = nil // --noflush: declaring a chain flushes it
			} else {
				work.Chains = append(work.Chains, name)
			}
		default:
			if err := f.command(work, line, n, withCounters, fail); err != nil {
				return err
			}
		}
	}
	if work != nil {
		return fmt.Errorf("iptables-restore: COMMIT expected at line %d", strings.Count(payload, "\n")+1)
	}
	return nil
}

// command applies one -A, -D or -X line of a restore to the table being built.
func (f *Fake) command(work *Table, line string, n int, withCounters bool, fail func(string) error) error {
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
	if !work.Has(chain) {
		return fail(fmt.Sprintf("chain %s does not exist", chain))
	}
	switch fields[0] {
	case "-A":
		at := slices.Index(fields, "-j")
		if at < 0 {
			at = slices.Index(fields, "-g")
		}
		if at < 0 || at+1 == len(fields) {
			return fail("rule without a target")
		}
		target := fields[at+1]
		if !slices.Contains(builtinTargets, target) && !work.Has(target) {
			return fail(fmt.Sprintf("Couldn't load target `%s'", target))
		}
		if f.RejectRandomFully && slices.Contains(fields, "--random-fully") {
			return fmt.Errorf("iptables-restore: line %d failed: Invalid argument", n)
		}
		work.Rules[chain] = append(work.Rules[chain], Rule{Text: line, Packets: packets, Bytes: bytes})
	case "-D":
		want := "-A" + strings.TrimPrefix(line, "-D")
		i := slices.IndexFunc(work.Rules[chain], func(r Rule) bool { return r.Text == want })
		if i < 0 {
			return fmt.Errorf("iptables-restore: line %d failed: Bad rule (does a matching rule exist in that chain?).", n)
		}
		work.Rules[chain] = slices.Delete(work.Rules[chain], i, i+1)
	case "-X":
		for c, rules := range work.Rules {
			for _, r := range rules {
				if (strings.HasSuffix(r.Text, "-j "+chain) || strings.HasSuffix(r.Text, "-g "+chain)) && c != chain {
					return fmt.Errorf("iptables-restore: line %d failed: Directory not empty.", n)
				}
			}
		}
		if len(work.Rules[chain]) > 0 {
			return fmt.Errorf("iptables-restore: line %d failed: Directory not empty.", n)
		}
		delete(work.Rules, chain)
		work.Chains = slices.DeleteFunc(work.Chains, func(c string) bool { return c == chain })
	default:
		return fail("unsupported command " + fields[0])
	}
	return nil
}

// ChainTexts returns the rule texts of a chain.
func (f *Fake) ChainTexts(mode iptables.Mode, fam policy.Family, chain string) []string {
	var out []string
	for _, r := range f.NAT(mode, fam).Rules[chain] {
		out = append(out, r.Text)
	}
	return out
}

// Restores returns the payloads of the restore calls made so far.
func (f *Fake) Restores() []string {
	var out []string
	for _, c := range f.Calls {
		if strings.HasSuffix(c.Name, "-restore") && !slices.Contains(c.Args, "--version") {
			out = append(out, c.Stdin)
		}
	}
	return out
}
