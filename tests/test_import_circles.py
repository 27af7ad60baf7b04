"""No module of hetpipe_tf imports itself through others: the package's import graph (every import
statement, those inside functions too, as grimp reads them) has no circle."""
import grimp


def import_circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module of `graph` (Tarjan's algorithm,
    iterative), each sorted: every circle of imports lies within one."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            following = next(imported, None)
            if following is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while not component or component[-1] != module:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        circles.append(sorted(component))
            elif following not in index:
                index[following] = low[following] = len(index)
                stack.append(following)
                on_stack.add(following)
                work.append((following, iter(sorted(graph.find_modules_directly_imported_by(following)))))
            elif following in on_stack:
                low[module] = min(low[module], index[following])
    return circles


def test_no_module_of_the_package_is_in_an_import_circle():
    graph = grimp.build_graph("hetpipe_tf", cache_dir=None)
    assert import_circles(graph) == [], "modules that import each other (break the circle, not with a late import)"


def test_a_circle_through_a_late_import_is_found():
    graph = grimp.build_graph("hetpipe_tf", cache_dir=None)
    graph.add_import(importer="hetpipe_tf.runtime.run_config", imported="hetpipe_tf.runtime.virtual_worker",
                     line_number=1, line_contents="from hetpipe_tf.runtime.virtual_worker import VirtualWorker")
    circles = import_circles(graph)
    assert len(circles) == 1
    assert {"hetpipe_tf.runtime.run_config", "hetpipe_tf.runtime.virtual_worker"} <= set(circles[0])
