package docs

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/cli"
)

const reference = "docs/reference.md"

// agentCommand is how the reference's "commands" column names the agent itself.
const agentCommand = "agent"

// helpFlag is one flag as a command's --help shows it.
type helpFlag struct {
	name, def string // def: "" where --help shows no default (a zero value)
	group     string // the title of the group it is listed under: "BPF backend" for "BPF backend flags:"
}

var (
	flagLineRE = regexp.MustCompile(`^\s+--?([a-z0-9][a-z0-9-]*)\b`)
	groupRE    = regexp.MustCompile(`^(\S.*) flags:$`)
	defaultRE  = regexp.MustCompile(`\(default (.*)\)\s*$`)
)

// help runs `ip-masq-agent [COMMAND] --help` and reads the flags it lists, by name.
func help(t *testing.T, command string) map[string]helpFlag {
	t.Helper()
	args := []string{"--help"}
	if command != agentCommand {
		args = []string{command, "--help"}
	}
	var stdout, stderr bytes.Buffer
	if err := cli.Run(context.Background(), args, &stdout, &stderr); err != nil && !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("ip-masq-agent %s: %v", strings.Join(args, " "), err)
	}
	flags := map[string]helpFlag{}
	var cur *helpFlag
	var block []string
	done := func() {
		if cur == nil {
			return
		}
		if m := defaultRE.FindStringSubmatch(strings.Join(block, " ")); m != nil {
			cur.def = m[1]
			if s, err := strconv.Unquote(m[1]); err == nil {
				cur.def = s
			}
		}
		flags[cur.name] = *cur
	}
	group := ""
	for _, l := range strings.Split(stdout.String()+stderr.String(), "\n") {
		if m := groupRE.FindStringSubmatch(l); m != nil {
			group = m[1]
		}
		if m := flagLineRE.FindStringSubmatch(l); m != nil {
			done()
			cur, block = &helpFlag{name: m[1], group: group}, []string{l}
			continue
		}
		if strings.TrimSpace(l) == "" || !strings.HasPrefix(l, " ") && !strings.HasPrefix(l, "\t") {
			done() // a blank line or a heading ends the flag's text
			cur = nil
			continue
		}
		block = append(block, strings.TrimSpace(l))
	}
	done()
	return flags
}

// subcommands lists the commands `ip-masq-agent help` names.
func subcommands(t *testing.T) []string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	if err := cli.Run(context.Background(), []string{"help"}, &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(stdout.String(), "\n") {
		_, rest, ok := strings.Cut(l, "ip-masq-agent ")
		if f := strings.Fields(rest); ok && len(f) > 0 && !strings.HasPrefix(f[0], "[") && !strings.HasPrefix(f[0], "COMMAND") {
			out = append(out, f[0])
		}
	}
	if len(out) == 0 {
		t.Fatal("ip-masq-agent help names no command")
	}
	return out
}

// The reference's Commands block names every command.
func TestReferenceListsEveryCommand(t *testing.T) {
	section, ok := markdown.Section(read(t, reference), "## Commands")
	if !ok {
		t.Fatalf("%s has no Commands section", reference)
	}
	for _, c := range subcommands(t) {
		if !strings.Contains(section, "ip-masq-agent "+c+" ") && !strings.Contains(section, "ip-masq-agent "+c+"\n") {
			t.Errorf("%s, Commands, does not name %s", reference, c)
		}
	}
}

// The reference's flag tables list, for each command, exactly the flags its --help shows, with
// their defaults, each under the heading of its --help group ("### BPF backend flags").
func TestReferenceListsEveryFlag(t *testing.T) {
	section, ok := markdown.Section(read(t, reference), "## Flags")
	if !ok {
		t.Fatalf("%s has no Flags section", reference)
	}
	type row struct{ def, heading string }
	listed := map[string]map[string]row{}   // command -> flag -> row
	parts := map[string]string{"": section} // heading -> its text; "": the section's
	if first := strings.Index(section, "\n### "); first >= 0 {
		parts[""] = section[:first]
	}
	for _, h := range markdown.Headings(section) {
		parts[strings.TrimPrefix(h, "### ")], _ = markdown.Section(section, h)
	}
	for heading, text := range parts {
		for _, cells := range markdown.Rows(text) {
			if len(cells) != 4 || !strings.HasPrefix(cells[0], "`--") {
				t.Errorf("%s, Flags: row %q: want 4 cells: flag, default, commands, meaning", reference, cells)
				continue
			}
			name := strings.TrimPrefix(strings.Trim(cells[0], "`"), "--")
			def, err := tableDefault(cells[1])
			if err != nil {
				t.Errorf("%s, Flags: --%s: %v", reference, name, err)
			}
			for _, c := range strings.Split(cells[2], ",") {
				c = strings.TrimSpace(c)
				if listed[c] == nil {
					listed[c] = map[string]row{}
				}
				if _, dup := listed[c][name]; dup {
					t.Errorf("%s, Flags: --%s of %s listed twice", reference, name, c)
				}
				listed[c][name] = row{def, heading}
			}
		}
	}
	commands := append([]string{agentCommand}, subcommands(t)...)
	for c := range listed {
		if !slices.Contains(commands, c) {
			t.Errorf("%s, Flags: no command %q (the commands are %s)", reference, c, strings.Join(commands, ", "))
		}
	}
	for _, c := range commands {
		flags := help(t, c)
		for _, name := range slices.Sorted(maps.Keys(flags)) {
			f := flags[name]
			r, ok := listed[c][name]
			if !ok {
				t.Errorf("%s, Flags: %s's --%s is not listed (its commands column must name %s)", reference, c, name, c)
				continue
			}
			if r.def != f.def && !(f.def == "" && zero(r.def)) {
				t.Errorf("%s, Flags: %s's --%s defaults to %q, the table says %q", reference, c, name, f.def, r.def)
			}
			if want := f.group + " flags"; f.group != "" && !strings.EqualFold(r.heading, want) {
				t.Errorf("%s, Flags: %s's --%s is under %q, --help lists it under %q", reference, c, name, r.heading, want)
			}
		}
		for name := range listed[c] {
			if _, ok := flags[name]; !ok {
				t.Errorf("%s, Flags: lists --%s for %s, which %s --help does not show", reference, name, c, c)
			}
		}
	}
}

// tableDefault reads a default cell: a code span ("`1s`"), or "empty" with perhaps a remark
// after it, which is the empty string.
func tableDefault(cell string) (string, error) {
	if strings.HasPrefix(cell, "empty") {
		return "", nil
	}
	if spans := markdown.CodeSpans(cell); len(spans) == 1 && cell == "`"+spans[0]+"`" {
		return spans[0], nil
	}
	return "", errors.New("the default must be one code span, or empty")
}

// zero tells whether a default is a zero value, which --help does not show.
func zero(def string) bool {
	switch def {
	case "", "false", "0", "0s":
		return true
	}
	return false
}
