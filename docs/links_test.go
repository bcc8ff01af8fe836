// Package docs holds the tests that keep the documentation true: links resolve, examples print
// what the pages show, the flags and log messages are all there. The pages are its Markdown
// files, README.md and SECURITY.md.
package docs

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
)

// pages are the documentation's Markdown files, relative to the repository's root.
func pages(t *testing.T) []string {
	t.Helper()
	root := repoRoot(t)
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil || len(docs) == 0 {
		t.Fatalf("no pages in docs/: %v", err)
	}
	out := []string{"README.md", "SECURITY.md"}
	for _, d := range docs {
		out = append(out, filepath.Join("docs", filepath.Base(d)))
	}
	return out
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := markdown.Root()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func read(t *testing.T, page string) string {
	t.Helper()
	s, err := markdown.Read(page)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// anchors lists the link targets of a page's headings, as GitHub numbers repeated ones.
func anchors(page string) []string {
	var out []string
	seen := map[string]int{}
	for _, h := range markdown.Headings(page) {
		a := markdown.Anchor(h)
		if n := seen[a]; n > 0 {
			out = append(out, fmt.Sprintf("%s-%d", a, n))
		} else {
			out = append(out, a)
		}
		seen[a]++
	}
	return out
}

var linkRE = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// Every relative link of every page names a file of the repository, and a heading of it where
// it names one.
func TestLinksResolve(t *testing.T) {
	root := repoRoot(t)
	for _, page := range pages(t) {
		text := read(t, page)
		for _, m := range linkRE.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
			}
			if _, err := os.Stat(filepath.Join(root, path)); err != nil {
				t.Errorf("%s links to %s: no such file", page, target)
				continue
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(path, ".md") {
				t.Errorf("%s links to %s: an anchor in a file that is no page", page, target)
				continue
			}
			if !slices.Contains(anchors(read(t, path)), anchor) {
				t.Errorf("%s links to %s: %s has no heading %q", page, target, path, anchor)
			}
		}
	}
}

var pageRefRE = regexp.MustCompile(`\bdocs/[a-z0-9-]+\.md\b`)

// Every mention of a docs page in the repository's code, manifests and pages names one that
// exists: a page moved or renamed leaves no stale pointer behind.
func TestPageMentionsExist(t *testing.T) {
	root := repoRoot(t)
	skip := map[string]bool{".git": true, "bin": true, "headers": true, "testdata": true}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if skip[d.Name()] {
				return filepath.SkipDir
			}
			return nil
		}
		switch filepath.Ext(path) {
		case ".go", ".md", ".yaml", ".json", ".sh", ".c", ".h":
		default:
			if d.Name() != "Makefile" {
				return nil
			}
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, ref := range pageRefRE.FindAllString(string(b), -1) {
			if _, err := os.Stat(filepath.Join(root, ref)); err != nil {
				rel, _ := filepath.Rel(root, path)
				t.Errorf("%s mentions %s, which does not exist", rel, ref)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
