package docs

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
)

// The commands the pages give name what exists: every make target is in the Makefile, every
// `go test` names packages whose tests or benchmarks match its -run and -bench, every
// manifest, kustomization or chart a kubectl or helm command names is in the repository.
// (The examples that print something are run by TestExamplesPrintWhatThePagesShow.)
func TestCommandsNameWhatExists(t *testing.T) {
	root := repoRoot(t)
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, page := range pages(t) {
		for _, cmd := range shellCommands(t, read(t, page)) {
			f := strings.Fields(cmd)
			var problem string
			switch f[0] {
			case "make":
				for _, target := range f[1:] {
					if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(target) + `:`).Match(makefile) {
						problem = "the Makefile has no target " + target
					}
				}
			case "go":
				if len(f) > 1 && f[1] == "test" {
					problem = checkGoTest(root, f[2:])
				}
			case "kubectl", "helm":
				for _, a := range f[1:] {
					if strings.HasPrefix(a, "deploy/") {
						if _, err := os.Stat(filepath.Join(root, a)); err != nil {
							problem = a + " does not exist"
						}
					}
				}
			default:
				continue
			}
			checked++
			if problem != "" {
				t.Errorf("%s: `%s`: %s", page, cmd, problem)
			}
		}
	}
	if checked == 0 {
		t.Error("no page gives a make, go test, kubectl or helm command")
	}
}

// shellCommands returns the commands a page gives: the lines of its sh blocks and the code
// spans of its text that start with a command this test checks, comments and "$ " cut off.
func shellCommands(t *testing.T, page string) []string {
	t.Helper()
	var out []string
	add := func(s string) {
		s, _, _ = strings.Cut(s, " #")
		s = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(strings.TrimPrefix(s, "$ ")), "\\"))
		if f := strings.Fields(s); len(f) > 0 && (f[0] == "make" || f[0] == "go" || f[0] == "kubectl" || f[0] == "helm") {
			out = append(out, s)
		}
	}
	blocks, err := markdown.Blocks(page)
	if err != nil {
		t.Fatal(err)
	}
	var prose []string
	fenced := false
	for _, l := range strings.Split(page, "\n") {
		if strings.HasPrefix(l, "```") {
			fenced = !fenced
			continue
		}
		if !fenced {
			prose = append(prose, l)
		}
	}
	for _, b := range blocks {
		if b.Lang == "sh" {
			for _, l := range strings.Split(b.Body, "\n") {
				add(l)
			}
		}
	}
	for _, s := range markdown.CodeSpans(strings.Join(prose, " ")) {
		add(s)
	}
	return out
}

// checkGoTest checks the arguments of a `go test` command: its packages exist, and each of
// -run and -bench matches a test or benchmark of them. It says what is wrong, or "".
func checkGoTest(root string, args []string) string {
	var pkgs []string
	var run, bench string
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case (a == "-run" || a == "-bench") && i+1 < len(args):
			v := strings.Trim(args[i+1], "'\"")
			if a == "-run" {
				run = v
			} else {
				bench = v
			}
			i++
		case strings.HasPrefix(a, "./"):
			pkgs = append(pkgs, a)
		case a == "-count" || a == "-benchtime" || a == "-timeout":
			i++
		}
	}
	if len(pkgs) == 0 {
		return "" // a pattern such as "-run TestX ./pkg/x" shows the form, not a package
	}
	var tests, benches []string
	for _, p := range pkgs {
		if p == "./pkg/x" {
			return "" // the form, as above
		}
		names, err := testFuncs(filepath.Join(root, p))
		if err != nil {
			return err.Error()
		}
		for _, n := range names {
			if strings.HasPrefix(n, "Test") {
				tests = append(tests, n)
			} else {
				benches = append(benches, n)
			}
		}
	}
	if problem := matchesOne(run, tests, "test"); problem != "" {
		return problem
	}
	return matchesOne(bench, benches, "benchmark")
}

// matchesOne tells whether the top-level part of a -run or -bench pattern matches one of names.
func matchesOne(pattern string, names []string, what string) string {
	switch pattern {
	case "", "^$", "NAME": // none, none on purpose, or the form of the command
		return ""
	}
	top, _, _ := strings.Cut(pattern, "/")
	re, err := regexp.Compile(top)
	if err != nil {
		return "bad pattern " + pattern + ": " + err.Error()
	}
	for _, n := range names {
		if re.MatchString(n) {
			return ""
		}
	}
	return "no " + what + " matches " + pattern
}

// testFuncs lists the Test and Benchmark functions of the package in dir.
func testFuncs(dir string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*_test.go"))
	if err != nil || len(files) == 0 {
		return nil, os.ErrNotExist
	}
	var out []string
	fset := token.NewFileSet()
	for _, file := range files {
		f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv == nil &&
				(strings.HasPrefix(fd.Name.Name, "Test") || strings.HasPrefix(fd.Name.Name, "Benchmark")) {
				out = append(out, fd.Name.Name)
			}
		}
	}
	return out, nil
}
